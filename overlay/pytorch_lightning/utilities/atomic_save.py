"""Atomic checkpoint saves: a checkpoint is streamed into a temporary file next to its destination and renamed over
it once complete, and the temporary files of saves killed mid-write are cleaned up later.

The hook is :func:`pytorch_lightning.utilities.cloud_io.atomic_save`, which calls :func:`save_atomically`, and
``TorchCheckpointIO.load_checkpoint``, which calls :func:`remove_stale_temporary_files_next_to`.
"""
# fork-feature: fork/streaming-atomic-save.patch
import hashlib
import logging
import os
import re
import secrets
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pytorch_lightning.utilities.types import _PATH

log = logging.getLogger(__name__)


def save_atomically(checkpoint: Dict[str, Any], filepath: Union[str, Path]) -> bool:
    """Stream ``checkpoint`` into ``filepath`` so that the file appears only once complete. Returns ``False`` for a
    filesystem that cannot open a file for writing inside an ``fsspec`` transaction: the caller then serializes the
    checkpoint into memory and writes it, as Lightning 1.6.5 did.

    Args:
        checkpoint: what :func:`torch.save` saves.
        filepath: a local or ``fsspec`` path.
    """
    fs, path = url_to_fs(str(filepath))
    if isinstance(fs, LocalFileSystem):
        _atomic_save_local(checkpoint, path)
        return True
    if getattr(fs, "_intrans", False):
        # inside the caller's own transaction on this filesystem, which decides whether the file is published
        with fs.open(path, "wb") as f:
            torch.save(checkpoint, f)
        return True
    with fs.transaction:
        try:
            f = fs.open(path, "wb")
        except Exception:
            # no deferred write on this filesystem (the caller's fallback raises again if it cannot write at all)
            return False
        with f:
            torch.save(checkpoint, f)
    return True


def _atomic_save_local(checkpoint: Dict[str, Any], path: str) -> None:
    # Write through a symlink to its target, as writing to the link's path used to.
    path = os.path.realpath(path)
    dirname, basename = os.path.split(path)
    remove_stale_temporary_files(dirname)
    tmp_path, fd = _create_temporary_file(dirname, basename)
    try:
        # ``closefd=False``: the descriptor is closed below, once the file is renamed or removed
        with os.fdopen(fd, "wb", closefd=False) as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.remove(tmp_path)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
    _fsync_directory(dirname)


#: ``<basename>.<host id>.<pid>.<8 hex digits>.tmp``, the name :func:`_create_temporary_file` gives a checkpoint
#: being written: the host id and process id of its writer (see :func:`_writer_host_id`) and a random part
_TEMPORARY_FILE_NAME = re.compile(r"^.+\.(?P<host>[0-9a-f]{12})\.(?P<pid>[1-9][0-9]*)\.[0-9a-f]{8}\.tmp$")

#: ``<basename>.<8 hex digits>.tmp``, the name earlier revisions of the fork gave a checkpoint being written
_LEGACY_TEMPORARY_FILE_NAME = re.compile(r"^.+\.[0-9a-f]{8}\.tmp$")

#: How long a temporary file whose writer this process cannot look up (one written on another host or in another PID
#: namespace, or named by an earlier revision) must have gone unmodified before it counts as the debris of a killed
#: save. A save in progress modifies its file far more often: its writes pause only for the per-unit collectives of a
#: streamed save, which the FSDP process group's timeout bounds (minutes by default).
STALE_TEMPORARY_FILE_AGE = timedelta(hours=24)

#: how every checkpoint written by ``torch.save`` (a zip archive) begins
_ZIP_MAGIC = b"PK\x03\x04"

#: the longest file name most filesystems allow (``NAME_MAX``, in bytes)
_NAME_MAX = 255


def _boot_id(proc_root: str = "/proc") -> str:
    """What identifies this machine until it reboots: the kernel's boot id on Linux, else the host name and the
    hardware address (``uuid.getnode``).

    Args:
        proc_root: where ``procfs`` is mounted.
    """
    try:
        with open(os.path.join(proc_root, "sys", "kernel", "random", "boot_id")) as f:
            boot_id = f.read().strip()
        if boot_id:
            return boot_id
    except OSError:
        pass
    return f"{socket.gethostname()}-{uuid.getnode():012x}"


def _writer_host_id() -> str:
    """12 hex digits naming this machine (see :func:`_boot_id`) and this process's PID namespace: processes with the
    same host id see each other's process ids, so one of them can tell whether another is still running."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{_boot_id()}\0{namespace}".encode()).hexdigest()[:12]


def _create_temporary_file(dirname: str, basename: str) -> Tuple[str, int]:
    """Create a new, uniquely named ``<basename>.<host id>.<pid>.<random>.tmp`` in ``dirname`` and return its path
    and a descriptor open for writing.

    The name says which process writes the file, which is how :func:`remove_stale_temporary_files` tells a save in
    progress from the debris of a killed one. No lock is taken: ``flock`` fails on some network filesystems (NFSv3
    without a lock daemon: ``ENOLCK``; Lustre mounted without ``flock``: ``ENOSYS``), is emulated with per-process
    byte-range locks on others (NFS), and on some covers only the local host (``local_lock``, ``localflock``).
    ``<basename>`` is shortened if the name would be longer than filesystems allow.

    Unlike :func:`tempfile.mkstemp`, the file gets the permissions ``open()`` would give it (``0o666`` minus the
    umask), so the renamed checkpoint is readable as before.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    writer = f".{_writer_host_id()}.{os.getpid()}"
    room = max(_NAME_MAX - len(writer) - len(".01234567.tmp"), 1)
    basename = os.fsencode(basename)[:room].decode(errors="ignore") or "checkpoint"
    while True:
        tmp_path = os.path.join(dirname, f"{basename}{writer}.{secrets.token_hex(4)}.tmp")
        try:
            return tmp_path, os.open(tmp_path, flags, 0o666)
        except FileExistsError:
            continue


def _remove_if_stale(entry: "os.DirEntry[str]", host: str) -> bool:
    """Remove ``entry`` if it is a temporary file of a save whose writer is gone (see
    :func:`remove_stale_temporary_files`), and return whether it did."""
    match = _TEMPORARY_FILE_NAME.match(entry.name)
    if match is None and not _LEGACY_TEMPORARY_FILE_NAME.match(entry.name):
        return False
    writer: Optional[int] = None
    if match is not None and match["host"] == host and os.name != "nt":
        writer = int(match["pid"])
        if _process_exists(writer):
            return False  # its save is in progress (or its process id was taken again: left for now)
    try:
        if not entry.is_file(follow_symlinks=False):
            return False
        fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if writer is None and time.time() - os.fstat(fd).st_mtime < STALE_TEMPORARY_FILE_AGE.total_seconds():
            return False  # its writer, elsewhere, may still be at it
        if os.read(fd, len(_ZIP_MAGIC)) not in (b"", _ZIP_MAGIC) or not _same_file(entry.path, fd):
            return False
        os.remove(entry.path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _process_exists(pid: int) -> bool:
    """Whether a process with id ``pid`` runs in this PID namespace (also one of another user, or a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # e.g. ``EPERM``: it exists, but belongs to another user
    return True


def remove_stale_temporary_files_next_to(path: _PATH) -> List[str]:
    """:func:`remove_stale_temporary_files` of the directory of ``path``, a checkpoint about to be loaded, if it is
    local; the paths removed.

    Args:
        path: a local or ``fsspec`` path.
    """
    fs, fs_path = url_to_fs(str(path))
    if not isinstance(fs, LocalFileSystem):
        return []
    return remove_stale_temporary_files(os.path.dirname(os.path.realpath(fs_path)))


def remove_stale_temporary_files(dirname: _PATH) -> List[str]:
    """Remove the temporary files that saves into local directory ``dirname`` left behind when their process was
    killed (``kill -9``, preemption) while writing, and return their paths.

    :func:`~pytorch_lightning.utilities.cloud_io.atomic_save` writes into ``<name>.<host id>.<pid>.<8 hex digits>.tmp``
    and renames it over ``<name>`` when done, so a killed save leaves such a file, as large as the checkpoint, that
    nothing else would ever remove. A file is only removed if it is a regular file with exactly that name, it is empty
    or begins like a file written by :func:`torch.save`, and its writer is gone:

    - written on this host, in this PID namespace (the same host id), by a process that no longer exists;
    - written anywhere else, or named by an earlier revision of the fork (``<name>.<8 hex digits>.tmp``): not
      modified for :data:`STALE_TEMPORARY_FILE_AGE` (24 hours), as the process that writes it cannot be looked up.

    No file lock is involved, so this works on filesystems where ``flock`` fails or covers one host only. On Windows,
    where process ids are not checked, every file is judged by its age. Errors are ignored: cleaning up must never
    make a save or a resume fail.

    Args:
        dirname: the directory to clean up.
    """
    removed: List[str] = []
    try:
        entries = list(os.scandir(dirname))
    except OSError:
        return removed
    host = _writer_host_id()
    removed = [entry.path for entry in entries if _remove_if_stale(entry, host)]
    if removed:
        log.info(f"Removed {len(removed)} temporary file(s) left behind by interrupted checkpoint saves: {removed}")
    return removed


def _fsync_directory(dirname: str) -> None:
    """Persist a rename in ``dirname``; not possible (nor needed) on every platform, so failures are ignored."""
    try:
        fd = os.open(dirname, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
