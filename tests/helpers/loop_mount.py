"""A small real filesystem for a test: an ext4 image file, made with ``mkfs.ext4`` and mounted through a loop device
(``mount -o loop``), so that the kernel itself runs out of space (``ENOSPC``) or refuses a call the filesystem lacks
(``fallocate`` on an ext4 without extents: ``EOPNOTSUPP``). Needs Linux, root, ``mkfs.ext4`` and a free loop device;
:func:`loop_mount_unavailable` says why not.
"""
import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence


def loop_mount_unavailable() -> Optional[str]:
    """Why :func:`mounted_ext4` cannot run here, or ``None``."""
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control)"
    if os.geteuid() != 0:
        return "mounting a loop device needs root"
    if shutil.which("mkfs.ext4") is None:
        return "no mkfs.ext4"
    return None


@contextmanager
def mounted_ext4(folder: Path, size_mb: int, features: Sequence[str] = ()) -> Iterator[Path]:
    """An empty ext4 filesystem of ``size_mb`` MiB mounted at ``folder/mnt`` while the block runs, its image in
    ``folder``; unmounted (lazily, should a process still hold a file) and removed after.

    Args:
        folder: a folder of the host filesystem for the image and the mount point.
        size_mb: the image's size.
        features: ``mkfs.ext4 -O`` features, e.g. ``("^extent", "^64bit")`` for block-mapped files, which refuse
            ``fallocate``.

    Raises:
        subprocess.CalledProcessError: where ``mkfs.ext4`` or ``mount`` fails (no free loop device, no
            ``CAP_SYS_ADMIN``); nothing is left behind then.
    """
    image, mount_point = folder / f"ext4-{uuid.uuid4().hex[:8]}.img", folder / "mnt"
    mount_point.mkdir(parents=True, exist_ok=True)
    try:
        with open(image, "wb") as file:
            file.truncate(size_mb * 2**20)
        command = ["mkfs.ext4", "-q", "-F"] + (["-O", ",".join(features)] if features else []) + [str(image)]
        subprocess.run(command, check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], check=True, capture_output=True)
        try:
            yield mount_point
        finally:
            subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)
    finally:
        image.unlink(missing_ok=True)
