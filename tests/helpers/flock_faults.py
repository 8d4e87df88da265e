"""File locks as filesystems without working ``flock`` give them, for the process that calls :func:`install`.

- ``"enolck"``: NFSv3 mounted without a lock daemon (``nolock`` missing, ``rpc.statd``/``lockd`` not running):
  ``flock`` and POSIX record locks fail with ``ENOLCK`` ("No locks available").
- ``"enosys"``: Lustre mounted without ``-o flock`` or ``-o localflock``: both fail with ``ENOSYS`` ("Function not
  implemented").
- ``"nfs"``: NFS with working locks. Linux's NFS client implements ``flock`` with a POSIX lock on the whole file
  (``nfs_flock`` in ``fs/nfs/file.c``), so it takes one here, with ``fcntl.lockf``: an exclusive lock needs a
  descriptor open for writing (else ``EBADF``), the lock belongs to the process, not the descriptor, and it goes away
  as soon as the process closes *any* descriptor of the file.

Installed by patching the ``fcntl`` module, which is where code calls ``fcntl.flock`` from, so no ``LD_PRELOAD`` is
needed; scenario scripts call :func:`install` on every rank.
"""
import errno
import fcntl
import os
from typing import Any, Callable, Optional

KINDS = ("enolck", "enosys", "nfs")

_REAL = {"flock": fcntl.flock, "lockf": fcntl.lockf}


def _failing(code: int) -> Callable[..., Any]:
    def lock(fd: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    return lock


def _flock_as_byte_range_lock(fd: Any, operation: int) -> Any:
    # what the NFS client does with ``flock``: the same operation as a whole-file POSIX lock of this process
    return _REAL["lockf"](fd, operation)


def install(kind: Optional[str]) -> None:
    """Make this process's file locks behave as on the filesystem ``kind`` (see :data:`KINDS`); ``None`` restores
    the real ones."""
    if kind is None:
        fcntl.flock, fcntl.lockf = _REAL["flock"], _REAL["lockf"]
    elif kind == "enolck":
        fcntl.flock, fcntl.lockf = _failing(errno.ENOLCK), _failing(errno.ENOLCK)
    elif kind == "enosys":
        fcntl.flock, fcntl.lockf = _failing(errno.ENOSYS), _failing(errno.ENOSYS)
    elif kind == "nfs":
        fcntl.flock, fcntl.lockf = _flock_as_byte_range_lock, _REAL["lockf"]
    else:
        raise ValueError(f"unknown kind of filesystem {kind!r}, expected one of {KINDS}")
