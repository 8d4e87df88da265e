"""Node-local scratch, emulated on one host: a process that sees another directory at a path, as a rank on another
node sees its own ``/scratch`` (or local NVMe) at the same path as global rank 0's.

:func:`see_other_directory_at` moves the calling thread into a mount namespace of its own (``unshare --mount``),
makes every mount in it private, so that nothing propagates back to the other processes, and bind-mounts a directory
over the path there. Files written at the path by the other processes are not visible to it, and its own are not
visible to them. Needs Linux and ``CAP_SYS_ADMIN`` (root); :func:`mount_namespace_unavailable` says why not.

Python 3.11 has no ``os.unshare``, hence ``ctypes``. ``unshare(CLONE_NEWNS)`` gives the calling thread its own
namespace (and its own filesystem context, ``CLONE_FS``); the other threads of a process (gloo's, OpenMP's) keep the
old one, so the caller must be the thread that reads and writes the files, the main thread of a scenario.
"""
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Union

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

def _call(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def see_other_directory_at(path: Union[str, Path], other: Union[str, Path]) -> None:
    """From now on, this thread (and the processes it starts) sees directory ``other`` at ``path``.

    Args:
        path: an existing directory, e.g. the checkpoint directory.
        other: the directory to see there instead.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    _call(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # as ``unshare --mount --propagation private``: ``/`` is usually shared, and the bind mount would reach the host
    _call(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _call(libc.mount(os.fsencode(str(other)), os.fsencode(str(path)), None, MS_BIND, None), f"mount --bind {other}")


def mount_namespace_unavailable() -> Optional[str]:
    """Why :func:`see_other_directory_at` cannot run here (not Linux, not root, no ``unshare`` in this container),
    or ``None``; tried for real in a child process."""
    if not sys.platform.startswith("linux"):
        return "mount namespaces are Linux's"
    if os.geteuid() != 0:
        return "bind mounts in a mount namespace of its own need root (CAP_SYS_ADMIN)"
    with tempfile.TemporaryDirectory() as folder:
        path, other = Path(folder, "path"), Path(folder, "other")
        path.mkdir()
        other.mkdir()
        (other / "seen").touch()
        # this file as a script: importing ``tests.helpers`` would import torch and Lightning (seconds)
        run = subprocess.run(
            [sys.executable, __file__, str(path), str(other)], capture_output=True, text=True, timeout=60
        )
        if run.returncode != 0:
            return f"cannot bind-mount in a mount namespace of its own here: {run.stderr.strip().splitlines()[-1:]}"
        if os.listdir(path):
            return "the bind mount of a private mount namespace reached this process"
    return None


if __name__ == "__main__":
    see_other_directory_at(sys.argv[1], sys.argv[2])
    assert os.listdir(sys.argv[1]) == ["seen"], os.listdir(sys.argv[1])
