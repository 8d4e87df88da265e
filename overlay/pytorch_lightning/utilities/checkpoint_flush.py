"""When the streamed checkpoint file is ``fsync``-ed: after every chunk, or only once before it is renamed into place,
depending on the filesystem it is written to (read from the mount table) or on ``PL_CHECKPOINT_CHUNK_FSYNC``.

Used by :class:`~pytorch_lightning.utilities.streamed_checkpoint_file._StreamedCheckpointFile`.
"""
# fork-feature: fork/fsdp-streaming-save.patch
import os
from fnmatch import fnmatchcase
from pathlib import PurePosixPath
from typing import Any, Hashable, NamedTuple, Optional, Set

from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_info

#: Environment variable: ``1`` ``fdatasync``-s the streamed checkpoint file after every chunk, ``0`` only ``fsync``-s
#: it once before it is renamed into place, ``auto`` (or unset) decides from the filesystem it is on.
CHUNK_FSYNC_ENV = "PL_CHECKPOINT_CHUNK_FSYNC"

#: The filesystem types (``fnmatch`` patterns, as the mount table names them) on which an ``fsync`` is not a local
#: flush: FUSE mounts of object stores (``fuse.gcsfuse``, ``fuse.s3fs``, ``fuse.blobfuse2``, ...) upload the whole
#: object on every ``fsync``, and the file already has its full size once its skeleton is written, so each chunk
#: would upload the whole checkpoint again; on NFS and Lustre every ``fsync`` waits for the server to commit the
#: data to its storage, which would add that round trip to every chunk. ``fuseblk`` (a FUSE driver of a local block
#: device, e.g. ntfs-3g) is not matched.
REMOTE_FSYNC_FSTYPES = ("fuse", "fuse.*", "nfs*", "lustre")

#: FUSE filesystems of the patterns above that are local: ``fuse-overlayfs`` is the root filesystem of rootless
#: containers, on the host's disk.
LOCAL_FUSE_FSTYPES = ("fuse.fuse-overlayfs",)


class _Mount(NamedTuple):
    """A line of the mount table: where a filesystem is mounted, and its type."""

    mount_point: str
    fstype: str


class _ChunkFsyncPolicy(NamedTuple):
    """Whether a streamed checkpoint file is ``fdatasync``-ed after every chunk.

    Args:
        fsync_chunks: ``True`` to ``fdatasync`` at every flush point, ``False`` to only ``fsync`` before the rename.
        reason: when ``fsync_chunks`` is ``False``, why, for the log line.
        log_key: when ``fsync_chunks`` is ``False``, what the log line is said once per process for: the mount (or
            the environment variable) the decision comes from.
    """

    fsync_chunks: bool
    reason: Optional[str] = None
    log_key: Optional[Hashable] = None


def _fsync_waits_on_server(fstype: str) -> bool:
    """Whether an ``fsync`` on a filesystem of this type uploads the file or waits on a server (see
    :data:`REMOTE_FSYNC_FSTYPES`)."""
    if fstype in LOCAL_FUSE_FSTYPES:
        return False
    return any(fnmatchcase(fstype, pattern) for pattern in REMOTE_FSYNC_FSTYPES)


def _mount_of(path: str) -> Optional[_Mount]:
    """The mount that ``path`` (after resolving its symlinks) is on: the one with the longest mount point that contains
    it, whole path components compared (``/mnt/a`` does not contain ``/mnt/ab``); of several at the same mount point,
    the last one mounted, which hides the others.

    The mount table is read with :func:`psutil.disk_partitions`: ``/etc/mtab``, or ``<psutil.PROCFS_PATH>/self/mounts``
    where ``PROCFS_PATH`` is not ``/proc``.

    Returns:
        The mount, or ``None`` if the mount table cannot be read (psutil is not installed, or fails on this
        platform) or has no mount containing ``path``.
    """
    try:
        import psutil

        partitions = psutil.disk_partitions(all=True)
    except Exception:
        return None
    parts = PurePosixPath(os.path.realpath(path)).parts
    found: Optional[_Mount] = None
    depth = -1
    for partition in partitions:
        # psutil has already decoded the kernel's escapes (``\040`` for a space, ...). The mount points are not
        # resolved: the kernel writes them resolved, and a ``stat`` could hang on an unreachable server.
        mount_parts = PurePosixPath(partition.mountpoint).parts
        if parts[: len(mount_parts)] == mount_parts and len(mount_parts) >= depth:
            found, depth = _Mount(partition.mountpoint, partition.fstype), len(mount_parts)
    return found


#: The default of ``mount`` arguments: read the mount table.
READ_MOUNT_TABLE: Any = object()


def _chunk_fsync_policy(path: str, mount: Optional[_Mount] = READ_MOUNT_TABLE) -> _ChunkFsyncPolicy:
    """Whether a streamed checkpoint file written into the directory ``path`` is ``fdatasync``-ed after every chunk:
    as ``PL_CHECKPOINT_CHUNK_FSYNC`` says (``1``: yes, ``0``: no), else (``auto``, unset or empty) unless ``path`` is
    on a filesystem whose ``fsync`` uploads the file or waits on a server (:data:`REMOTE_FSYNC_FSTYPES`). If the mount
    table cannot be read, it is.

    Args:
        path: the directory.
        mount: the mount of ``path`` (:func:`_mount_of`) where the caller read it already, so that one save reads the
            mount table once; by default it is read here.

    Raises:
        MisconfigurationException:
            If ``PL_CHECKPOINT_CHUNK_FSYNC`` is set to anything but ``auto``, ``1`` or ``0``.
    """
    value = os.environ.get(CHUNK_FSYNC_ENV, "").strip().lower()
    if value not in ("", "auto", "0", "1"):
        raise MisconfigurationException(
            f"`{CHUNK_FSYNC_ENV}` must be `auto` (decide from the filesystem, the default), `1` (`fdatasync` the"
            f" streamed checkpoint after every chunk) or `0` (only `fsync` it before it is renamed into place), got"
            f" {os.environ[CHUNK_FSYNC_ENV]!r}."
        )
    if value == "1":
        return _ChunkFsyncPolicy(True)
    if value == "0":
        return _ChunkFsyncPolicy(False, f"`{CHUNK_FSYNC_ENV}=0`", CHUNK_FSYNC_ENV)
    if mount is READ_MOUNT_TABLE:
        mount = _mount_of(path)
    if mount is None or not _fsync_waits_on_server(mount.fstype):
        return _ChunkFsyncPolicy(True)
    reason = (
        f"{path!r} is on a `{mount.fstype}` mount ({mount.mount_point}), where `fsync` uploads the file or waits on"
        " the server"
    )
    return _ChunkFsyncPolicy(False, reason, mount)


#: The log keys of the policies logged so far in this process (see :func:`_log_chunk_fsync_policy`).
_LOGGED: Set[Hashable] = set()


def _log_chunk_fsync_policy(policy: _ChunkFsyncPolicy, flush_bytes: int) -> None:
    """Say, once per process for each mount (or for the environment variable), that streamed checkpoints are not
    ``fdatasync``-ed after every chunk of ``flush_bytes``."""
    if policy.fsync_chunks or policy.log_key in _LOGGED:
        return
    _LOGGED.add(policy.log_key)
    advice = "" if policy.log_key == CHUNK_FSYNC_ENV else f" (set `{CHUNK_FSYNC_ENV}=1` to flush every chunk)"
    rank_zero_info(
        f"`DDPFullyShardedStrategy`: {policy.reason}: the streamed checkpoint is `fsync`-ed only once, before it is"
        f" renamed into place, not every {flush_bytes / 2**20:g} MiB{advice}."
    )
