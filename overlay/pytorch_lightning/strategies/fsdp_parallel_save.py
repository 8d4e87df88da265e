"""The parallel FSDP save (``DDPFullyShardedStrategy(checkpoint_writers="all")``): global rank 0 writes the
checkpoint's structure as the streamed save does (:mod:`.fsdp_streaming_save`), then every rank writes the valid
ranges of its own shards of the FSDP parameters and of their optimizer state straight into the same temporary file
with ``pwrite``, from its own memory. No collective carries tensor data but the bytes of the blocks that several
ranks' ranges touch (:func:`_block_owners`), so that no two ranks write into one block of the file.

With ``async_checkpoint=True``, a save during ``fit`` copies each rank's shards to host memory, and every rank's
background thread writes its own copies into the file (the background save's machinery, see
:mod:`.fsdp_async_checkpoint`): no unit is gathered, and global rank 0 holds only its own copies.

The hook is the checkpointer's ``save_if_streamed``, which passes :func:`_write_units_by_every_rank` to the streamed
save, and :func:`_plan_own_writes` for global rank 0 to run once it wrote the structure, where
``checkpoint_writers`` is ``"all"``, or ``"auto"`` (the default) with more than one process.
"""
# fork-feature: fork/fsdp-parallel-save.patch
import itertools
import os
from dataclasses import replace
from functools import partial
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple, TYPE_CHECKING

import torch

from pytorch_lightning.strategies.fsdp_async_checkpoint import (
    _BackgroundSave,
    _BackgroundWork,
    _saves_in_background,
    _start_background_save,
)
from pytorch_lightning.strategies.fsdp_async_host_memory import _host_copies_fit, _HostCopies
from pytorch_lightning.strategies.fsdp_checkpoint_errors import _new_checkpoint_guard
from pytorch_lightning.strategies.fsdp_introspection import (
    _flat_shard,
    _fsdp_instances,
    _outermost_fsdp_instances,
    _piece_offsets,
    _shard_range,
)
from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream
from pytorch_lightning.strategies.fsdp_lost_writers import _naming_lost_ranks
from pytorch_lightning.strategies.fsdp_streaming_save import _streamed_optimizer_tensors, _UnitsWriter
from pytorch_lightning.strategies.fsdp_writer_decision import (  # noqa: F401 (the strategy's argument check)
    _checked_checkpoint_writers,
    _decide_checkpoint_writers,
    _Probe,
    _probe_wanted,
    _remove_probe,
    _write_probe_for_ranks,
)
from pytorch_lightning.utilities.checkpoint_crc import _CrcLedger, _Piece
from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_process_group
from pytorch_lightning.utilities.checkpoint_flush import _chunk_fsync_policy, _Mount, _mount_of
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.file_preallocation import _preallocate
from pytorch_lightning.utilities.local_file_storage import _LocalFileStorage
from pytorch_lightning.utilities.streamed_checkpoint_file import _committed_if_complete, _StreamedCheckpointFile

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

#: No two ranks write into one block of this many bytes (default 4096, a page: NFS clients write back whole pages);
#: raise it to the stripe size on Lustre or GPFS, whose extent locks are per stripe.
WRITE_BLOCK_ENV = "PL_CHECKPOINT_WRITE_BLOCK"

#: Where a rank's bytes come from: ``("param", instance index, flat index)`` or ``("optim", optimizer-state key)``.
_Source = Tuple[Any, ...]


class _Extent(NamedTuple):
    """``nbytes`` bytes of the file at ``offset`` that global rank ``rank`` writes from byte ``at`` of ``source``."""

    offset: int
    nbytes: int
    rank: int
    source: _Source
    at: int


class _RecordTable(NamedTuple):
    """Where the FSDP records of the file lie, in terms every rank can resolve: for each flat parameter (instance
    index, flat index) its pieces' byte offsets (a tied weight has one per name), and each optimizer-state record's."""

    path: str
    params: Dict[Tuple[int, int], List[Tuple[int, int]]]
    optimizer: Dict[Tuple[Any, ...], int]


def _write_block_size() -> int:
    """The block size of :data:`WRITE_BLOCK_ENV`.

    Raises:
        MisconfigurationException: if it is not a positive multiple of 4096.
    """
    value = os.environ.get(WRITE_BLOCK_ENV, "").strip() or "4096"
    if not value.isdigit() or int(value) == 0 or int(value) % 4096:
        raise MisconfigurationException(f"`{WRITE_BLOCK_ENV}` must be a positive multiple of 4096, got {value!r}.")
    return int(value)


class _RankZeroPlan(NamedTuple):
    """What global rank 0 sends every rank with the checkpoint's structure (:func:`_plan_own_writes`): where the
    FSDP records lie, the probe file of the writers' decision (``None`` where none is wanted), and the storage every
    rank writes into (the temporary file beside the checkpoint)."""

    table: _RecordTable
    probe: Optional[_Probe]
    storage: _LocalFileStorage

    def discard(self) -> None:
        """On global rank 0, once the writers' decision is made or the save stopped before it: remove the probe file
        (if the decision has not, or rank 0 wrote none)."""
        _remove_probe(os.path.dirname(self.table.path), self.probe)


def _plan_own_writes(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, writer: _StreamedCheckpointFile
) -> _RankZeroPlan:
    """On global rank 0, once it wrote the structure into ``writer``: the :class:`_RankZeroPlan`, sent to every rank
    in the broadcast of its decision (see ``_write_streamed_skeleton``). It allocates the file's blocks where its
    filesystem gains from it (:func:`_preallocate`), makes the structure visible to the other ranks' clients
    (``fsync``: close-to-open on NFS) and writes the probe file.

    Raises:
        OSError: ``ENOSPC`` where the file's blocks do not fit; the save then fails on every rank before any rank
            writes, and the temporary file is removed.
    """
    _preallocate(writer.fileno(), writer.mount)
    os.fsync(writer.fileno())
    table = _record_table(strategy, stream, writer)
    wanted = _probe_wanted(strategy, strategy.checkpoint_writers)
    probe = _write_probe_for_ranks(os.path.dirname(writer.tmp_path)) if wanted else None
    return _RankZeroPlan(table, probe, writer.storage)


def _write_units_by_every_rank(
    strategy: "DDPFullyShardedStrategy",
    stream: _CheckpointStream,
    writer: Optional[_StreamedCheckpointFile],
    fallback: _UnitsWriter,
) -> None:
    """Once global rank 0 wrote the structure into ``writer`` and sent every rank its plan (``stream.plan``, see
    :func:`_plan_own_writes`), every rank writes its own shards into the file where
    :func:`~.fsdp_writer_decision._decide_checkpoint_writers` says so (from host copies, in its background thread,
    where the save may go to the background and the copies fit), else ``fallback`` (the streamed save) writes the
    units. Collective."""
    plan: _RankZeroPlan = stream.plan
    table = plan.table
    try:
        # each rank reads its own mount table once per save, for the writers' decision and its chunks' flushes
        mount = writer.mount if writer is not None else _mount_of(os.path.dirname(table.path))
        decision = _decide_checkpoint_writers(strategy, table.path, strategy.checkpoint_writers, plan.probe, mount)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        if writer is not None:
            plan.discard()
    if decision[0] != "all":
        return fallback(strategy, stream, writer)
    if _saves_in_background(strategy) and _host_copies_fit(strategy, stream, writer, gathered=False):
        return _start_background_save(strategy, writer, partial(_copy_own_writes, strategy, stream, plan, mount))
    guard = _new_checkpoint_guard(strategy)
    with _committed_if_complete(writer):
        with _naming_lost_ranks(strategy, guard, table.path):
            pieces = _write_own_shards(strategy, stream, plan, guard, mount)
            failed_ranks = guard.settle()
            if not failed_ranks:
                _send_crcs_to_writer(pieces, writer, _checkpoint_process_group(strategy))
        if not failed_ranks and writer is not None:
            writer.complete = True
    guard.raise_if_failed()


def _record_table(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, writer: _StreamedCheckpointFile
) -> _RecordTable:
    """The :class:`_RecordTable` of the placeholders of ``stream`` in ``writer``'s file, on global rank 0."""
    flats = {
        id(flat): (i, j)
        for i, instance in enumerate(_fsdp_instances(strategy.lightning_module))
        for j, flat in enumerate(instance.params)
    }
    params: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for key, placeholder in stream.model.items():
        flat_id, piece = stream.model_sources[key]
        params.setdefault(flats[flat_id], []).append((piece, writer.offset_of(placeholder)))
    optimizer = {key: writer.offset_of(flat) for key, flat in stream.optimizer_placeholders.items()}
    return _RecordTable(writer.tmp_path, params, optimizer)


def _write_own_shards(
    strategy: "DDPFullyShardedStrategy",
    stream: _CheckpointStream,
    plan: _RankZeroPlan,
    guard: _CollectiveGuard,
    mount: Optional[_Mount],
) -> List[_Piece]:
    """Every rank writes its own bytes of the FSDP records, and those of other ranks in the blocks it owns (sent
    over the checkpoint group), then ``fdatasync``-s and closes its descriptor; returns the CRC-32 of the pieces it
    wrote. A failure is recorded in ``guard``."""
    writes = None
    with guard.catch():
        writes = _own_writes(strategy, stream, plan, mount)
    group = _checkpoint_process_group(strategy)
    return _write_planned(writes, guard, group, torch.device("cpu") if group is not None else strategy.root_device)


class _OwnWrites(NamedTuple):
    """What global rank ``rank`` writes into ``storage`` (with this rank's flush policy): the ``parts`` of every
    rank's extents with their writers (see :func:`_split_at_blocks`), and this rank's tensors they come from, by
    source."""

    storage: _LocalFileStorage
    rank: int
    parts: List[Tuple[int, _Extent]]
    sources: Dict[_Source, torch.Tensor]


def _own_writes(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, plan: _RankZeroPlan, mount: Optional[_Mount]
) -> _OwnWrites:
    """This rank's :class:`_OwnWrites` of ``stream`` into the storage of ``plan``, from the shapes and its shards,
    and its flush policy on ``mount``, this rank's mount of the file's directory.

    Raises:
        MisconfigurationException: where this rank's ``PL_CHECKPOINT_CHUNK_FSYNC`` is invalid (a failure of this
            rank, which the caller's guard reports to the others).
    """
    fsync_chunks = _chunk_fsync_policy(os.path.dirname(plan.table.path), mount).fsync_chunks
    optimizer_shards = list(_optimizer_shards(strategy, stream))
    extents = _extents(strategy, optimizer_shards, plan.table)
    block = _write_block_size()
    parts = _split_at_blocks(extents, _block_owners(extents, block), block)
    sources = _own_sources(strategy, optimizer_shards)
    storage = replace(plan.storage, fsync_chunks=fsync_chunks)
    return _OwnWrites(storage, strategy.global_rank, parts, sources)


def _copy_own_writes(
    strategy: "DDPFullyShardedStrategy",
    stream: _CheckpointStream,
    plan: _RankZeroPlan,
    mount: Optional[_Mount],
    pool: _HostCopies,
) -> _BackgroundWork:
    """This rank's :class:`_OwnWrites` from host copies of its shards (from ``pool``), and their writing by its
    background thread: the block bytes over the background group, then its own ranges."""
    writes = _own_writes(strategy, stream, plan, mount)
    copies = {source: pool.copy(tensor) for source, tensor in writes.sources.items()}
    writes = writes._replace(sources=copies)

    def write(job: _BackgroundSave) -> None:
        # a rank lost in the exchanges (its own or the final agreement, which the background save's own ``settle``
        # then returns without another exchange) is named, as in a synchronous save: ``wait_for_checkpoint`` raises
        # the ``_PeerLost`` on every rank without another exchange
        with _naming_lost_ranks(strategy, job.guard, plan.table.path, close_group=False):
            pieces = _write_planned(writes, job.guard, job.group, torch.device("cpu"))
            if not job.guard.settle():
                _send_crcs_to_writer(pieces, job.writer, job.group)

    return _BackgroundWork(list(copies.values()), write)


def _write_planned(
    writes: Optional[_OwnWrites], guard: _CollectiveGuard, group: Optional[Any], device: torch.device
) -> List[_Piece]:
    """Send the bytes of ``writes`` in blocks other ranks own to them over ``group`` (through ``device``), receive
    theirs in the blocks this rank owns, then write this rank's parts, ``fdatasync`` and close; returns the CRC-32 of
    every piece this rank wrote (none where it failed). A failure is recorded
    in ``guard``, for the ranks' next agreement (the caller's ``settle``); ``writes`` is ``None`` where this rank
    failed to plan them. The ranks agree once before the exchange, so a rank that could not plan its writes or
    allocate its buffers says so there and is not taken for a lost rank; a rank that dies in the exchange does not
    reach the next agreement, which names it (see ``_naming_lost_ranks``). Collective over ``group``."""
    exchange = None
    if writes is not None:
        with guard.catch():
            sources = {s: tensor.detach().reshape(-1).view(torch.uint8) for s, tensor in writes.sources.items()}
            exchange = _BlockExchange.prepare(writes.rank, writes.parts, sources, device)
    if not guard.agree():
        return []
    with guard.catch():
        exchange.run(group)
    if guard.failed:
        return []
    with guard.catch():
        own = (
            (extent.offset, sources[extent.source][extent.at : extent.at + extent.nbytes])
            for owner, extent in writes.parts
            if extent.rank == writes.rank and owner == writes.rank
        )
        crcs = _CrcLedger()
        # one peer's bytes at a time: ``received`` copies each peer's buffer to the CPU as it goes
        writes.storage.write(itertools.chain(own, exchange.received()), crcs)
        return crcs.pieces
    return []


def _send_crcs_to_writer(
    pieces: List[_Piece], writer: Optional[_StreamedCheckpointFile], group: Optional[Any]
) -> None:
    """Once every rank wrote its pieces and closed its descriptor: their CRC-32s, a few integers per piece, gathered
    over ``group`` to global rank 0, whose ``writer`` combines them per record when it commits the file (see
    :meth:`_StreamedCheckpointFile.commit`; it writes the descriptors and the central directory through a new
    descriptor of its own, so that no block is written by two ranks at once). Collective over ``group``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: Optional[List[Any]] = [None] * torch.distributed.get_world_size(group) if writer is not None else None
        torch.distributed.gather_object(pieces, gathered, dst=0, group=group)
    else:
        gathered = [pieces]
    if writer is not None:
        assert gathered is not None
        for rank_pieces in gathered:
            writer.add_crcs(rank_pieces)


#: An optimizer-state shard of this rank: the key of its record, the shard and the unpadded size of the flat tensor.
_OptimizerShard = Tuple[Tuple[Any, ...], torch.Tensor, int]


def _own_sources(
    strategy: "DDPFullyShardedStrategy", optimizer_shards: List[_OptimizerShard]
) -> Dict[_Source, torch.Tensor]:
    """This rank's flat shards (full precision) and optimizer-state shards (flattened), by source: the tensors a save
    in the background copies (see ``_shards_to_copy``)."""
    sources = {
        ("param", i, j): _flat_shard(flat)
        for i, instance in enumerate(_fsdp_instances(strategy.lightning_module))
        for j, flat in enumerate(instance.params)
    }
    sources.update({("optim", key): value.reshape(-1) for key, value, _ in optimizer_shards})
    return sources


def _optimizer_shards(strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream) -> Iterator[_OptimizerShard]:
    """The optimizer-state shards of the FSDP instances, as the streamed save gathers them; none for a weights-only
    save."""
    if stream.weights_only:
        return
    roots = _outermost_fsdp_instances(strategy.lightning_module)
    for index, optimizer in enumerate(strategy.optimizers):
        for _, key, value, numel in _streamed_optimizer_tensors(optimizer, index, roots):
            yield key, value, numel


def _extents(
    strategy: "DDPFullyShardedStrategy", optimizer_shards: List[_OptimizerShard], table: _RecordTable
) -> List[_Extent]:
    """Every rank's bytes of the FSDP records, by offset in the file: the same list on every rank, from the
    shapes alone."""
    world_size, extents = strategy.world_size, []
    for i, instance in enumerate(_fsdp_instances(strategy.lightning_module)):
        for j, flat in enumerate(instance.params):
            starts, itemsize = _piece_offsets(flat), _flat_shard(flat).element_size()
            for piece, offset in table.params.get((i, j), []):
                begin, end = starts[piece], starts[piece + 1]
                for rank, lo, hi in _shards_over(begin, end, starts[-1], world_size):
                    first, last = max(lo, begin), min(hi, end)
                    at, size = offset + (first - begin) * itemsize, (last - first) * itemsize
                    extents.append(_Extent(at, size, rank, ("param", i, j), (first - lo) * itemsize))
    for key, value, numel in optimizer_shards:
        itemsize = value.element_size()
        for rank, lo, hi in _shards_over(0, numel, numel, world_size):
            extents.append(_Extent(table.optimizer[key] + lo * itemsize, (hi - lo) * itemsize, rank, ("optim", key), 0))
    return sorted(extents, key=lambda extent: extent.offset)


def _shards_over(begin: int, end: int, total: int, world_size: int) -> Iterator[Tuple[int, int, int]]:
    """The ranks whose shards of a flat tensor of ``total`` elements hold some of its elements ``begin`` to ``end``
    with the range of the flat tensor each holds (see :func:`_shard_range`); none where ``begin == end``."""
    if begin >= end:
        return
    chunk, _, _ = _shard_range(total, 0, world_size)
    for rank in range(begin // chunk, (end - 1) // chunk + 1):
        _, lo, hi = _shard_range(total, rank, world_size)
        yield rank, lo, hi


def _block_owners(extents: List[_Extent], block: int) -> Dict[int, int]:
    """The writer of each block that an extent starts or ends in: the rank whose extent covers the block's first
    written byte. A block inside an extent is that extent's rank's alone (extents do not overlap)."""
    owners: Dict[int, int] = {}
    for extent in extents:  # by offset: the first extent to touch a block covers its first written byte
        for index in (extent.offset // block, (extent.offset + extent.nbytes - 1) // block):
            owners.setdefault(index, extent.rank)
    return owners


def _split_at_blocks(extents: List[_Extent], owners: Dict[int, int], block: int) -> List[Tuple[int, _Extent]]:
    """The extents cut where their first and last blocks end and begin, each part with the rank that writes it."""
    parts = []
    for extent in extents:
        end = extent.offset + extent.nbytes
        first_block_end = min(end, (extent.offset // block + 1) * block)
        last_block_start = max(extent.offset, (end - 1) // block * block)
        cuts = sorted({extent.offset, first_block_end, last_block_start, end})
        for lo, hi in zip(cuts, cuts[1:]):
            if lo < hi:
                owner = owners.get(lo // block, extent.rank)
                parts.append((owner, extent._replace(offset=lo, nbytes=hi - lo, at=extent.at + lo - extent.offset)))
    return parts


class _BlockExchange(NamedTuple):
    """The bytes global rank ``rank`` sends to the owners of the blocks they fall in, and the buffers it receives the
    other ranks' bytes in the blocks it owns into: one message per pair of ranks, its size known to both from the
    parts (see :func:`_split_at_blocks`)."""

    outgoing: Dict[int, torch.Tensor]
    incoming: Dict[int, List[_Extent]]
    buffers: Dict[int, torch.Tensor]

    @classmethod
    def prepare(
        cls, rank: int, parts: List[Tuple[int, _Extent]], sources: Dict[_Source, torch.Tensor], device: torch.device
    ) -> "_BlockExchange":
        """Allocate the messages and buffers on ``device``: local work, which may fail (out of memory) before any
        rank enters the exchange."""
        outgoing: Dict[int, List[torch.Tensor]] = {}
        incoming: Dict[int, List[_Extent]] = {}
        for owner, extent in parts:
            if extent.rank == rank and owner != rank:
                outgoing.setdefault(owner, []).append(sources[extent.source][extent.at : extent.at + extent.nbytes])
            elif owner == rank and extent.rank != rank:
                incoming.setdefault(extent.rank, []).append(extent)
        buffers = {
            peer: torch.empty(sum(e.nbytes for e in extents), dtype=torch.uint8, device=device)
            for peer, extents in incoming.items()
        }
        return cls({peer: torch.cat(data).to(device) for peer, data in outgoing.items()}, incoming, buffers)

    def run(self, group: Optional[Any]) -> None:
        """Send and receive every message over ``group``. Collective between the pairs of ranks that share a
        block."""
        requests = [torch.distributed.isend(data, peer, group=group) for peer, data in self.outgoing.items()]
        requests += [torch.distributed.irecv(buffer, peer, group=group) for peer, buffer in self.buffers.items()]
        for request in requests:
            request.wait()

    def received(self) -> Iterator[Tuple[int, torch.Tensor]]:
        """The bytes received, with their offsets in the file (on the CPU)."""
        for peer, extents in self.incoming.items():
            yield from zip((e.offset for e in extents), self.buffers[peer].cpu().split([e.nbytes for e in extents]))
