"""Atomic checkpoint saves: a checkpoint is streamed into a temporary file next to its destination and renamed over
it once complete, and the temporary files of saves killed mid-write are cleaned up later.

The hook is :func:`pytorch_lightning.utilities.cloud_io.atomic_save`, which calls :func:`save_atomically`, and
``TorchCheckpointIO.load_checkpoint``, which calls :func:`remove_stale_temporary_files`.
"""
# fork-feature: fork/streaming-atomic-save.patch
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pytorch_lightning.utilities.types import _PATH

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

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
        # ``closefd=False``: the descriptor, and with it the lock that marks the file as in use, is kept until the
        # rename is done, so that no other process takes the temporary file for the debris of a killed save
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


#: ``<basename>.<8 hex digits>.tmp``, the name :func:`_create_temporary_file` gives a checkpoint being written
_TEMPORARY_FILE_NAME = re.compile(r"^.+\.[0-9a-f]{8}\.tmp$")


#: how every checkpoint written by ``torch.save`` (a zip archive) begins
_ZIP_MAGIC = b"PK\x03\x04"


def _create_temporary_file(dirname: str, basename: str) -> Tuple[str, int]:
    """Create a new, uniquely named ``<basename>.<random>.tmp`` in ``dirname`` and return its path and descriptor.

    Unlike :func:`tempfile.mkstemp`, the file gets the permissions ``open()`` would give it (``0o666`` minus the
    umask), so the renamed checkpoint is readable as before. Where ``fcntl`` exists, the descriptor holds an exclusive
    advisory lock (``flock``) on the file until it is closed, which tells :func:`remove_stale_temporary_files` that
    the write is still in progress; the lock goes away with the process, also when it is killed.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp_path = os.path.join(dirname, f"{basename}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp_path, flags, 0o666)
        except FileExistsError:
            continue
        if fcntl is None:
            return tmp_path, fd
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(tmp_path, fd):
            return tmp_path, fd
        # removed as stale between its creation and the lock: start again with a new name
        os.close(fd)


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_stale_temporary_files(dirname: _PATH) -> List[str]:
    """Remove the temporary files that saves into local directory ``dirname`` left behind when their process was
    killed (``kill -9``, preemption) while writing, and return their paths.

    :func:`atomic_save` writes into ``<name>.<8 hex digits>.tmp`` and renames it over ``<name>`` when done, so a killed
    save leaves such a file, as large as the checkpoint, that nothing else would ever remove. A file is only removed
    if it is a regular file with exactly that name, it is empty or begins like a file written by :func:`torch.save`,
    and no process holds its lock, i.e. no save into it is in progress. Without ``fcntl`` (Windows) nothing is
    removed. Errors are ignored: cleaning up must never make a save or a resume fail.

    Args:
        dirname: the directory to clean up.
    """
    removed: List[str] = []
    if fcntl is None:
        return removed
    try:
        entries = list(os.scandir(dirname))
    except OSError:
        return removed
    for entry in entries:
        if not _TEMPORARY_FILE_NAME.match(entry.name):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a save is writing it
            if os.read(fd, len(_ZIP_MAGIC)) not in (b"", _ZIP_MAGIC) or not _same_file(entry.path, fd):
                continue
            os.remove(entry.path)
            removed.append(entry.path)
        except OSError:
            continue
        finally:
            os.close(fd)
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
