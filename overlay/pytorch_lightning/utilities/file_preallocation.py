"""The blocks of a checkpoint file allocated before several processes write into it.

The parallel save's temporary file is sparse once global rank 0 wrote its structure: every tensor's bytes are a hole.
Filling the holes of one file from several processes costs more than overwriting its allocated blocks (the blocks
are reserved and later allocated, under the file's locks, as the ranks write and flush), which
``fsdp_benchmarks.shared_file_writes`` measures on a given filesystem (docs/checkpoint_memory.md has this project's
ext4 figures). Rank 0 therefore allocates the file's blocks (as unwritten extents, no data written) before the ranks
write.

Only local block filesystems are preallocated (:data:`PREALLOCATED_FSTYPES`): on tmpfs ``fallocate`` takes and zeroes
shared memory up front, on NFS, Lustre and FUSE mounts it is emulated, refused or costs a round trip to the server.

Used by :mod:`~pytorch_lightning.strategies.fsdp_parallel_save`.
"""
# fork-feature: fork/fsdp-parallel-save.patch
import ctypes
import errno
import os
from functools import lru_cache
from typing import Any, Optional

from pytorch_lightning.utilities.checkpoint_flush import _Mount

#: The filesystem types (as the mount table names them) on which :func:`_preallocate` allocates a file's blocks.
PREALLOCATED_FSTYPES = ("ext4", "xfs")


@lru_cache(maxsize=1)
def _libc_fallocate() -> Any:
    """The C library's ``fallocate64`` (64-bit offsets on every platform), or ``None`` where it has none."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "fallocate64", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return function


def _fallocate(fd: int, offset: int, length: int) -> None:
    """``fallocate(2)`` with mode 0: allocate the blocks of ``length`` bytes at ``offset`` of ``fd``, keeping its data
    and, within its size, its size. Called directly, not through glibc's ``posix_fallocate``, which emulates a refused
    call by writing into every block (and fails on an ``O_WRONLY`` descriptor).

    Raises:
        OSError: with the call's ``errno`` (``ENOSPC``, ``EOPNOTSUPP``, ...); ``ENOSYS`` where the C library has no
            ``fallocate64``.
    """
    function = _libc_fallocate()
    if function is None:
        raise OSError(errno.ENOSYS, "fallocate: the C library has no fallocate64")
    while function(fd, 0, offset, length) != 0:
        code = ctypes.get_errno()
        if code != errno.EINTR:  # a signal arrived before any block was allocated: call again, as os.* calls do
            raise OSError(code, f"fallocate: {os.strerror(code)}")


def _preallocate(fd: int, mount: Optional[_Mount]) -> bool:
    """Allocate the blocks of the whole file ``fd`` where it is on a mount of :data:`PREALLOCATED_FSTYPES`; whether it
    did. A filesystem that refuses ``fallocate`` (``EOPNOTSUPP``) leaves the file as it was.

    Args:
        fd: a descriptor of the file, open for writing.
        mount: the mount the file is on (:func:`~pytorch_lightning.utilities.checkpoint_flush._mount_of`), ``None``
            where the mount table could not be read: then nothing is allocated.

    Raises:
        OSError: ``ENOSPC`` where the file's blocks do not fit on the filesystem, and any other error of the call.
    """
    if mount is None or mount.fstype not in PREALLOCATED_FSTYPES:
        return False
    size = os.fstat(fd).st_size
    if size == 0:
        return False
    try:
        _fallocate(fd, 0, size)
    except OSError as ex:
        if ex.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise
    return True
