"""Whether every rank can write its own pieces into the one checkpoint file (``checkpoint_writers="all"``), decided
before any data of a save is written.

Every rank must see the same file, and the filesystem must take writes to one file from several hosts at once:

- node-local scratch (``/tmp``, a local NVMe) mounted at the same path on every node passes every check but this
  one: global rank 0 writes a random token into a probe file next to the temporary checkpoint file, and every rank
  reads it back through its own path;
- FUSE mounts of object stores (gcsfuse, s3fs, blobfuse, rclone, ...) upload a file as one object, whole, from the
  host that wrote it: writers on several hosts overwrite each other's bytes (see
  :data:`CONCURRENT_WRITERS_REFUSED_FSTYPES`). A FUSE filesystem is only trusted with several writers when it is
  known to write through to a shared POSIX filesystem (:data:`CONCURRENT_WRITERS_FUSE_FSTYPES`).

and the job must be set up for it (:func:`_setup_refusal`): FSDP sharding over every rank, and a gloo checkpoint
group where the ranks run on GPUs.

The parallel save calls :func:`_decide_checkpoint_writers` once per save, on every rank.
"""
# fork-feature: fork/fsdp-parallel-save.patch
import os
import secrets
import weakref
from contextlib import suppress
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from pytorch_lightning.strategies.fsdp_introspection import _fsdp_instances
from pytorch_lightning.utilities.atomic_save import _create_temporary_file, _fsync_directory, _ZIP_MAGIC
from pytorch_lightning.utilities.checkpoint_errors import (
    _all_gather_objects,
    _broadcast_failure,
    _checkpoint_process_group,
    _distributed_run,
)
from pytorch_lightning.utilities.checkpoint_flush import _Mount, _mount_of, READ_MOUNT_TABLE
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_info

#: The values of ``DDPFullyShardedStrategy(checkpoint_writers=...)``.
CHECKPOINT_WRITERS = ("auto", "all", "rank0")

#: Filesystem types (as the mount table names them) that do not take writes to one file from several hosts: FUSE
#: mounts of object stores keep a written file in a local staging copy and upload it as one whole object when it is
#: closed or synced, so each host's upload replaces the others' bytes.
CONCURRENT_WRITERS_REFUSED_FSTYPES = (
    "fuse.gcsfuse",
    "fuse.s3fs",
    "fuse.blobfuse2",
    "fuse.blobfuse",
    "fuse.rclone",
    "fuse.goofys",
    "fuse.geesefs",
    "fuse.mountpoint-s3",
    "fuse.ossfs",
)

#: The FUSE filesystem types trusted with writes to one file from several hosts: they pass writes through to a shared
#: POSIX filesystem (GlusterFS, CephFS, JuiceFS) or are local to the host (fuse-overlayfs in containers). Every other
#: ``fuse.*`` type is refused, as an object-store mount could silently lose the other hosts' bytes.
CONCURRENT_WRITERS_FUSE_FSTYPES = ("fuse.fuse-overlayfs", "fuse.glusterfs", "fuse.ceph-fuse", "fuse.juicefs")

#: The name the probe file starts with; :func:`_create_temporary_file` adds ``.<host id>.<pid>.<random>.tmp``, so
#: the stale-temporary-file rule of ``atomic_save`` removes a probe whose writer was killed.
PROBE_NAME = "checkpoint-writers-probe"

#: The last fallback reason said for each strategy, so that the info line is said when the decision changes, not at
#: every save.
_LAST_REASON: "weakref.WeakKeyDictionary[Any, Optional[str]]" = weakref.WeakKeyDictionary()


def _checked_checkpoint_writers(value: Any) -> str:
    """``value`` if it is one of :data:`CHECKPOINT_WRITERS`.

    Raises:
        MisconfigurationException: If it is not.
    """
    if value not in CHECKPOINT_WRITERS:
        raise MisconfigurationException(
            f"`checkpoint_writers` must be one of {', '.join(map(repr, CHECKPOINT_WRITERS))}, got {value!r}."
        )
    return value


def _refuses_concurrent_writers(fstype: str) -> bool:
    """Whether a filesystem of type ``fstype`` (e.g. ``fuse.gcsfuse``) loses, or may lose, writes to one file from
    several hosts (see :data:`CONCURRENT_WRITERS_REFUSED_FSTYPES` and :data:`CONCURRENT_WRITERS_FUSE_FSTYPES`)."""
    if fstype in CONCURRENT_WRITERS_REFUSED_FSTYPES:
        return True
    return fstype.startswith("fuse.") and fstype not in CONCURRENT_WRITERS_FUSE_FSTYPES


def _setup_refusal(strategy: Any) -> Optional[str]:
    """Why the job's setup rules out every rank writing its own shards, or ``None``; the same on every rank, so no
    rank needs to ask the others.

    - Each rank's pieces are placed by its global rank: FSDP must shard over every rank (not, e.g., within a node).
    - The bytes at block boundaries travel over the gloo checkpoint group, bounded by ``PL_CHECKPOINT_TIMEOUT``;
      without it (``PL_CHECKPOINT_GLOO_GROUP=0``) they would go over NCCL, whose point-to-point sends between two
      ranks that send to each other can block each other.
    """
    module = strategy.lightning_module
    for instance in _fsdp_instances(module) if module is not None else []:
        if instance.world_size != strategy.world_size:
            return f"FSDP shards over a process group of {instance.world_size} of the {strategy.world_size} ranks"
    if _checkpoint_process_group(strategy) is None and strategy.root_device.type == "cuda":
        return (
            "the job has no gloo checkpoint group (`PL_CHECKPOINT_GLOO_GROUP=0`) to exchange the bytes at block edges"
        )
    return None


def _mount_refusal(directory: str, mount: Optional[_Mount] = READ_MOUNT_TABLE) -> Optional[str]:
    """Why the mount that ``directory`` is on does not allow concurrent writers, or ``None`` if it does or if the
    mount table cannot be read. The reason holds ``{ranks}`` for the ranks that have it (see :func:`_reason`).

    Args:
        directory: the checkpoint directory, resolved against this process's own mount table.
        mount: its mount, where this rank read its mount table already (by default it is read here).
    """
    if mount is READ_MOUNT_TABLE:
        mount = _mount_of(directory)
    if mount is None or not _refuses_concurrent_writers(mount.fstype):
        return None
    kind = mount.fstype.split(".", 1)[-1]
    allows = "does not" if mount.fstype in CONCURRENT_WRITERS_REFUSED_FSTYPES else "is not known to"
    return (
        f"on {{ranks}}, the checkpoint directory {directory} is on a {kind} mount ({mount.mount_point}), which {allows}"
        " allow concurrent writers"
    )


def _write_probe(directory: str, token: str) -> str:
    """Create a probe file holding ``token`` in ``directory``, ``fsync``-ed with its directory entry; its path."""
    path, fd = _create_temporary_file(directory, PROBE_NAME)
    try:
        # it begins like a ``torch.save`` file: the stale-file rule removes only such files (or empty ones)
        os.write(fd, _ZIP_MAGIC + token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_directory(directory)
    return path


def _read_probe(path: str, token: str) -> Optional[str]:
    """Why this rank does not see the probe file holding ``token`` at ``path`` (its own path to the directory), or
    ``None`` if it does; with ``{ranks}`` as in :func:`_mount_refusal`."""
    directory = os.path.dirname(path)
    try:
        with open(path, "rb") as f:
            found = f.read()
    except FileNotFoundError:
        return f"{{ranks}} cannot see the file written by rank 0 at {directory}"
    except OSError as ex:
        return f"{{ranks}} cannot read the file written by rank 0 at {directory} ({type(ex).__name__}: {ex})"
    if found != _ZIP_MAGIC + token.encode():
        return f"{{ranks}} cannot read back what rank 0 wrote into the file at {directory} (it holds other bytes)"
    return None


class _Probe(NamedTuple):
    """What global rank 0 sends every rank of the probe file it wrote: its name in the directory (``None`` where it
    could not write it), the token in it, and why it could not (a cause with ``{ranks}``, see :func:`_reason`)."""

    name: Optional[str]
    token: str
    cause: Optional[str] = None


def _write_probe_for_ranks(directory: str) -> _Probe:
    """On global rank 0: the probe file, holding a random token, written into ``directory``."""
    token = secrets.token_hex(16)
    try:
        return _Probe(os.path.basename(_write_probe(directory, token)), token)
    except OSError as ex:
        return _Probe(None, token, f"{{ranks}} cannot write a file into {directory} ({type(ex).__name__}: {ex})")


def _remove_probe(directory: str, probe: Optional[_Probe]) -> None:
    """On global rank 0: remove the probe file ``probe`` names, if it wrote one."""
    if probe is not None and probe.name is not None:
        with suppress(FileNotFoundError):
            os.remove(os.path.join(directory, probe.name))


def _own_causes(directory: str, probe: _Probe, mount: Optional[_Mount] = READ_MOUNT_TABLE) -> List[str]:
    """This rank's reasons why it cannot be one of several writers into ``directory``: it does not see the probe
    file of ``probe`` there, or its mount (``mount``, by default read here) refuses concurrent writers."""
    causes = []
    if probe.name is not None:
        seen = _read_probe(os.path.join(directory, probe.name), probe.token)
        if seen is not None:
            causes.append(seen)
    refusal = _mount_refusal(directory, mount)
    if refusal is not None:
        causes.append(refusal)
    return causes


def _name_ranks(ranks: List[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def _reason(causes_by_rank: List[List[str]]) -> Optional[str]:
    """One sentence naming every cause and the ranks that have it (in place of its ``{ranks}``), in rank order, or
    ``None`` if no rank has one.

    Args:
        causes_by_rank: every rank's causes (see :func:`_own_causes`), by global rank.
    """
    ranks_of: Dict[str, List[int]] = {}
    for rank, causes in enumerate(causes_by_rank):
        for cause in causes:
            ranks_of.setdefault(cause, []).append(rank)
    if not ranks_of:
        return None
    return "; ".join(cause.replace("{ranks}", _name_ranks(ranks)) for cause, ranks in ranks_of.items())


def _probe_every_rank(
    strategy: Any, directory: str, probe: Optional[_Probe] = None, mount: Optional[_Mount] = READ_MOUNT_TABLE
) -> Optional[str]:
    """Rank 0 writes the probe file into ``directory``, every rank reads it and checks its mount, rank 0 removes it;
    the reason why not every rank can write (see :func:`_reason`), or ``None``, the same on every rank. Collective.

    Args:
        probe: the probe that rank 0 wrote and every rank received already (with the checkpoint's structure, see
            :mod:`.fsdp_parallel_save`); by default rank 0 writes it here and sends it to every rank.
        mount: this rank's mount of ``directory``, where it read its mount table already.
    """
    try:
        if probe is None:
            if strategy.global_rank == 0:
                probe = _write_probe_for_ranks(directory)
            # the name only, which every rank joins to its own path to the directory (a broadcast of any object over
            # the checkpoint group, despite its name)
            probe = _broadcast_failure(strategy, probe, src=0)
        rank_zero_cause = [probe.cause] if probe.cause is not None and strategy.global_rank == 0 else []
        causes_by_rank = _all_gather_objects(strategy, rank_zero_cause + _own_causes(directory, probe, mount))
    finally:
        if strategy.global_rank == 0:
            _remove_probe(directory, probe)
    return _reason(causes_by_rank)


def _probe_wanted(strategy: Any, requested: str) -> bool:
    """Whether :func:`_decide_checkpoint_writers` probes the directory: the same on every rank."""
    return requested != "rank0" and _distributed_run(strategy.world_size) and _setup_refusal(strategy) is None


def _decide_checkpoint_writers(
    strategy: Any,
    temporary_path: str,
    requested: str,
    probe: Optional[_Probe] = None,
    mount: Optional[_Mount] = READ_MOUNT_TABLE,
) -> Tuple[str, Optional[str]]:
    """Who writes the FSDP tensors of this save into ``temporary_path``: ``("all", None)`` (every rank its own
    shards) or ``("rank0", reason)`` (global rank 0 alone, as the streamed save). Collective when more than one
    process runs and ``requested`` is not ``"rank0"``, over the strategy's gloo checkpoint group (the default
    process group where it has none).

    With ``"auto"`` and ``"all"``, global rank 0 writes a random token into a probe file in the directory of
    ``temporary_path``, every rank reads it back through its own path to that directory, and every rank checks that
    the directory's mount allows concurrent writers (see :func:`_mount_refusal`). A single process writes alone
    either way: ``("all", None)``.

    Args:
        strategy: the strategy saving (its ``global_rank`` and ``world_size``, and its checkpoint group).
        temporary_path: the file the save writes into; only its directory is used.
        requested: ``checkpoint_writers``: ``"auto"``, ``"all"`` or ``"rank0"``.
        probe: the probe file that rank 0 wrote already where :func:`_probe_wanted` (:func:`_write_probe_for_ranks`),
            sent to every rank with the checkpoint's structure; by default rank 0 writes it and sends it here.
        mount: this rank's mount of the directory, where it read its mount table already.

    Returns:
        ``(writers, reason)``: ``reason`` says why ``"auto"`` falls back to ``"rank0"``, else it is ``None``. The
        first fallback, and each one for another reason, is said in an info line on global rank 0.

    Raises:
        MisconfigurationException:
            On every rank, if ``requested`` is ``"all"`` and not every rank can write, naming the ranks and why; or
            if ``requested`` is none of :data:`CHECKPOINT_WRITERS`.
    """
    _checked_checkpoint_writers(requested)
    if requested == "rank0" or not _distributed_run(strategy.world_size):
        return ("rank0" if requested == "rank0" else "all"), None
    directory = os.path.dirname(os.path.abspath(temporary_path))
    reason = _setup_refusal(strategy) or _probe_every_rank(strategy, directory, probe, mount)
    if reason is not None and requested == "all":
        raise MisconfigurationException(
            f"`DDPFullyShardedStrategy(checkpoint_writers='all')` needs every rank to write into one checkpoint"
            f" file, but {reason}. Where the directory is the cause, save into one that every rank shares on a"
            " filesystem that takes concurrent writers (NFS, Lustre, GPFS, ...); or set `checkpoint_writers='auto'`"
            " to let global rank 0 write alone where it cannot."
        )
    if reason is not None and _LAST_REASON.get(strategy) != reason:
        rank_zero_info(
            f"`DDPFullyShardedStrategy(checkpoint_writers='auto')`: global rank 0 writes the checkpoint alone, as"
            f" `checkpoint_writers='rank0'` does, because {reason}."
        )
    _LAST_REASON[strategy] = reason
    return ("rank0", reason) if reason is not None else ("all", None)
