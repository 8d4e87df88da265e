"""The parallel FSDP save into object storage: one ordinary S3 object, uploaded in parts by every rank.

Global rank 0 writes the checkpoint's structure as the streamed save does, into a local *scratch* file in which every
tensor of the FSDP units is a hole (it takes the room of the structure only), and starts a multipart upload
(:mod:`~pytorch_lightning.utilities.multipart_upload`). Every rank then knows, from the shapes alone, which rank holds
each byte of the object: its own shards of the FSDP parameters and optimizer state (the parallel save's extents, see
:mod:`.fsdp_parallel_save`), and rank 0 the rest (zip headers, pickle, the tensors outside FSDP, data descriptors,
central directory).

1. Every rank computes the CRC-32 of its own bytes; rank 0 gathers them (a few integers per piece) and writes the
   records' CRC-32s into the structure, which is then final.
2. The object is cut into parts of at most :func:`~pytorch_lightning.utilities.multipart_upload._part_size` bytes,
   where the ranks' runs of bytes meet, and each part goes to the rank that holds most of its bytes, as long as
   every rank uploads about its share (:func:`_parts`). The ranks go through the parts in rounds: in each round every
   rank takes its next :data:`PARTS_IN_FLIGHT` parts, receives the bytes of them it does not hold from their holders
   over the checkpoint group (one message per part and holder, straight into the part where it is one segment), and
   uploads them concurrently. So a rank holds at most ``PARTS_IN_FLIGHT`` parts of its own, and what it receives or
   sends in several segments of a part (rank 0's structure bytes among them) in one buffer per part.
3. Once every rank's parts succeeded (the ranks agree, as after a local parallel save), rank 0 gathers their ETags
   and checksums and completes the upload: the object appears at once. A failure on any rank, or a lost rank, aborts
   it instead; an earlier object at that URL stays as it was.

The object is the file a local save writes, byte for byte. The hook is the checkpointer's ``save_if_streamed``, for
a path on an S3 filesystem (s3fs).
"""
# fork-feature: fork/object-storage-checkpoints.patch
import bisect
import os
from functools import partial
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, TYPE_CHECKING

import torch

from pytorch_lightning.strategies.fsdp_async_checkpoint import (
    _BackgroundSave,
    _BackgroundWork,
    _saves_in_background,
    _start_background_save,
)
from pytorch_lightning.strategies.fsdp_async_host_memory import _host_copies_fit, _HostCopies
from pytorch_lightning.strategies.fsdp_checkpoint_errors import _new_checkpoint_guard
from pytorch_lightning.strategies.fsdp_lost_writers import _naming_lost_ranks
from pytorch_lightning.strategies.fsdp_parallel_save import (
    _Extent,
    _extents,
    _optimizer_shards,
    _own_sources,
    _record_table,
    _RecordTable,
    _send_crcs_to_writer,
)
from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream
from pytorch_lightning.utilities.checkpoint_crc import _crc32, _Piece
from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_process_group
from pytorch_lightning.utilities.checkpoint_location import _prepare_checkpoint_dir, _redacted
from pytorch_lightning.utilities.cloud_io import get_filesystem
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard
from pytorch_lightning.utilities.local_file_storage import _memory_of
from pytorch_lightning.utilities.multipart_upload import (
    _MultipartUpload,
    _part_size,
    _UploadedPart,
    S3_MAX_PARTS,
    S3_MIN_PART_BYTES,
)
from pytorch_lightning.utilities.object_storage import _MultipartObjectStorage
from pytorch_lightning.utilities.streamed_checkpoint_file import _committed_if_complete, _StreamedCheckpointFile

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

#: How many parts of its own a rank assembles and uploads at a time.
PARTS_IN_FLIGHT = 2
#: How many bytes of a GPU tensor are copied to the host at a time for their CRC-32.
_CRC_STAGING_BYTES = 8 * 2**20


class _Part(NamedTuple):
    """Part ``number`` (from 1) of the object: ``nbytes`` bytes at ``offset``, uploaded by global rank ``owner``,
    made of ``segments`` (by offset; ``source`` ``None``: the structure, from global rank 0's scratch file)."""

    number: int
    offset: int
    nbytes: int
    owner: int
    segments: List[_Extent]


class _UploadPlan(NamedTuple):
    """What global rank 0 sends every rank with the checkpoint's structure: where the FSDP records lie, the storage
    (the upload and the object's size) and its part size (rank 0's ``PL_CHECKPOINT_PART_BYTES``: every rank cuts the
    same parts)."""

    table: _RecordTable
    storage: _MultipartObjectStorage
    part_bytes: int

    @property
    def upload(self) -> _MultipartUpload:
        return self.storage.upload

    @property
    def size(self) -> int:
        return self.storage.size

    def discard(self) -> None:
        """Nothing to undo here: the scratch file's ``discard`` aborts the upload."""


def _plan_upload(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, writer: _StreamedCheckpointFile
) -> _UploadPlan:
    """On global rank 0, once it wrote the structure into its scratch ``writer``: check the bucket (never created),
    start the multipart upload, whose storage the writer's commit completes or its discard aborts, and return the
    :class:`_UploadPlan`.

    Raises:
        FileNotFoundError: if the bucket does not exist.
        PermissionError: if the client has no credentials, or they are refused.
    """
    fs = get_filesystem(writer.path)
    _prepare_checkpoint_dir(fs, writer.path)
    table = _record_table(strategy, stream, writer)
    size = os.fstat(writer.fileno()).st_size
    part_bytes = _part_size(size)  # a file S3 cannot take fails here, before any upload is started
    upload = _MultipartUpload.start(fs, writer.path)
    writer.storage = _MultipartObjectStorage(writer.path, upload, writer.tmp_path, size)
    return _UploadPlan(table, writer.storage, part_bytes)


def _upload_units_by_every_rank(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, writer: Optional[_StreamedCheckpointFile]
) -> None:
    """Every rank uploads its parts of the object (see the module's docstring), from host copies in its background
    thread where the save may go to the background and the copies fit; global rank 0 completes the upload once every
    rank's parts succeeded, or aborts it. Collective."""
    plan: _UploadPlan = stream.plan
    if _saves_in_background(strategy) and _host_copies_fit(strategy, stream, writer, gathered=False):
        return _start_background_save(strategy, writer, partial(_copy_own_uploads, strategy, stream, plan))
    guard = _new_checkpoint_guard(strategy)
    with _committed_if_complete(writer):
        with _naming_lost_ranks(strategy, guard, _save_name(plan)):
            share = None
            with guard.catch():
                share = _own_share(strategy, stream, plan)
            _upload_share(share, plan, writer, guard, _checkpoint_process_group(strategy))
        if not guard.failed_ranks and writer is not None:
            writer.complete = True
    guard.raise_if_failed()


def _copy_own_uploads(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, plan: _UploadPlan, pool: _HostCopies
) -> _BackgroundWork:
    """This rank's share of the upload from host copies of its shards (from ``pool``), and its upload by its
    background thread over the background group."""
    share = _own_share(strategy, stream, plan)
    copies = {source: pool.copy(tensor) for source, tensor in share.sources.items()}
    share = share._replace(sources=copies, device=torch.device("cpu"))

    def upload(job: _BackgroundSave) -> None:
        # as in the parallel save: a rank lost in the exchanges is named on every rank by ``wait_for_checkpoint``
        with _naming_lost_ranks(strategy, job.guard, _save_name(plan), close_group=False):
            _upload_share(share, plan, job.writer, job.guard, job.group)

    return _BackgroundWork(list(copies.values()), upload)


def _save_name(plan: _UploadPlan) -> str:
    """Names this save in the ranks' arrival marks: the upload's id is new for each save."""
    return f"{_redacted(plan.upload.url)} ({plan.upload.upload_id})"


class _Share(NamedTuple):
    """What global rank ``rank`` of ``world_size`` uploads: every rank's extents, this rank's tensors they come from,
    by source, and the device its messages to the other ranks go through (the CPU over the gloo checkpoint group; the
    strategy's device over the default group, ``PL_CHECKPOINT_GLOO_GROUP=0``)."""

    rank: int
    world_size: int
    extents: List[_Extent]
    sources: Dict[Any, torch.Tensor]
    device: torch.device


def _own_share(strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, plan: _UploadPlan) -> _Share:
    optimizer_shards = list(_optimizer_shards(strategy, stream))
    extents = _extents(strategy, optimizer_shards, plan.table)
    sources = _own_sources(strategy, optimizer_shards)
    group = _checkpoint_process_group(strategy)
    device = torch.device("cpu") if group is not None or strategy.world_size < 2 else strategy.root_device
    return _Share(strategy.global_rank, strategy.world_size, extents, sources, device)


def _upload_share(
    share: Optional[_Share],
    plan: _UploadPlan,
    writer: Optional[_StreamedCheckpointFile],
    guard: _CollectiveGuard,
    group: Optional[Any],
) -> None:
    """Upload this rank's parts of the object, then, once the ranks agree that all of them succeeded, hand every
    rank's parts to global rank 0's ``writer``, whose commit completes the upload (its storage's receipts).
    ``share`` is ``None`` where this rank failed to compute it. A failure is recorded in ``guard``. Collective over
    ``group``."""
    uploaded = _upload_own_parts(share, plan, writer, guard, group)
    if not guard.settle():
        parts = _gather_to_rank_zero(uploaded, share.world_size, group)
        if writer is not None:
            writer.receipts = [part for rank_parts in parts for part in rank_parts]


def _upload_own_parts(
    share: Optional[_Share],
    plan: _UploadPlan,
    writer: Optional[_StreamedCheckpointFile],
    guard: _CollectiveGuard,
    group: Optional[Any],
) -> List[_UploadedPart]:
    """This rank's share of the upload: the CRC-32s of its bytes to rank 0, then its parts, round by round; returns
    what completing the upload needs of them. A failure is recorded in ``guard``."""
    parts: List[_Part] = []
    sources: Dict[Any, torch.Tensor] = {}
    pieces: List[_Piece] = []
    storage = plan.storage
    if share is not None:
        with guard.catch():
            sources = {s: t.detach().reshape(-1).view(torch.uint8) for s, t in share.sources.items()}
            pieces = [
                (e.offset, e.nbytes, _crc_of(sources[e.source], e.at, e.nbytes))
                for e in share.extents
                if e.rank == share.rank
            ]
            parts = _parts(plan.size, plan.part_bytes, _cover(share.extents, plan.size), share.world_size)
            storage = storage.with_parts([part.offset for part in parts])
    if not guard.agree():
        return []
    _send_crcs_to_writer(pieces, writer, group)
    with guard.catch():
        if writer is not None:
            writer.write_crcs()
    fd = -1
    with guard.catch():
        # the writer's own descriptor is write-only
        fd = os.open(writer.tmp_path, os.O_RDONLY) if writer is not None else -1
    try:
        uploaded: List[_UploadedPart] = []
        for round_parts in _rounds(parts, share.world_size if share is not None else 1):
            if not guard.agree():
                return []
            exchange = None
            with guard.catch():
                exchange = _RoundExchange.prepare(share.rank, round_parts, sources, fd, share.device)
            if not guard.agree():
                return []
            with guard.catch():
                exchange.run(group)
                uploaded += storage.write(exchange.parts())
        return uploaded
    finally:
        if fd >= 0:
            os.close(fd)


def _crc_of(data: torch.Tensor, at: int, nbytes: int) -> int:
    """The CRC-32 of bytes ``at`` to ``at + nbytes`` of the flat byte tensor ``data`` (a GPU one in host-sized
    steps)."""
    if data.device.type == "cpu":
        return _crc32(_as_buffer(data[at : at + nbytes]))
    value = 0
    for start in range(at, at + nbytes, _CRC_STAGING_BYTES):
        value = _crc32(_as_buffer(data[start : min(start + _CRC_STAGING_BYTES, at + nbytes)].cpu()), value)
    return value


def _as_buffer(data: torch.Tensor) -> memoryview:
    return _memory_of(data.data_ptr(), data.numel())


def _cover(extents: List[_Extent], size: int) -> List[_Extent]:
    """``extents`` (by offset) with the gaps between them, global rank 0's structure (``source`` ``None``): every
    byte of the object of ``size`` bytes, once."""
    cover, position = [], 0
    for extent in extents:
        if extent.offset > position:
            cover.append(_Extent(position, extent.offset - position, 0, None, position))
        if extent.nbytes:
            cover.append(extent)
        position = max(position, extent.offset + extent.nbytes)
    if position < size:
        cover.append(_Extent(position, size - position, 0, None, position))
    return cover


def _parts(size: int, part_bytes: int, cover: List[_Extent], world_size: int) -> List[_Part]:
    """The parts of the object of ``size`` bytes that ``cover`` covers, each with its segments and its owner, one of
    the ``world_size`` ranks.

    A part ends where the holder of the bytes changes, once it holds S3's least part (5 MiB, more where 10,000
    parts would not hold the object), and is at most ``part_bytes``: where the ranks' runs of bytes are that long,
    most parts hold one rank's bytes, which that rank uploads without receiving any. The owner of a part is the
    rank holding most of its bytes (the lowest of equals), unless that rank already owns its share of the object
    (``size / world_size``): then the holder that owns least. So each rank uploads about its share also where the
    runs are shorter than a part and every part holds several ranks' bytes (4 ranks and shards of 4 MiB). (Parts
    cut at fixed offsets, each to the rank with most of its bytes, gave one rank nearly every part.)"""
    least = min(part_bytes, max(S3_MIN_PART_BYTES, -(-size // (S3_MAX_PARTS - 1))))
    cuts = [0]
    for i, extent in enumerate(cover):
        end = extent.offset + extent.nbytes
        while end - cuts[-1] > part_bytes:
            cuts.append(cuts[-1] + part_bytes)
        if i + 1 < len(cover) and cover[i + 1].rank != extent.rank and end - cuts[-1] >= least:
            cuts.append(end)
    if cuts[-1] < size:
        cuts.append(size)
    segments: List[List[_Extent]] = [[] for _ in range(len(cuts) - 1)]
    for extent in cover:
        end = extent.offset + extent.nbytes
        position = extent.offset
        while position < end:
            index = bisect.bisect_right(cuts, position) - 1
            cut = min(end, cuts[index + 1])
            segments[index].append(
                extent._replace(offset=position, nbytes=cut - position, at=extent.at + position - extent.offset)
            )
            position = cut
    parts, owned, share = [], [0] * world_size, size / world_size
    for index, part_segments in enumerate(segments):
        held: Dict[int, int] = {}
        for segment in part_segments:
            held[segment.rank] = held.get(segment.rank, 0) + segment.nbytes
        owner = min(held, key=lambda rank: (-held[rank], rank)) if held else 0
        if owned[owner] >= share:
            owner = min(held, key=lambda rank: (owned[rank], -held[rank], rank))
        nbytes = cuts[index + 1] - cuts[index]
        owned[owner] += nbytes
        parts.append(_Part(index + 1, cuts[index], nbytes, owner, part_segments))
    return parts


def _rounds(parts: List[_Part], world_size: int) -> List[List[_Part]]:
    """The parts in rounds: round ``k`` holds every rank's owned parts ``k * PARTS_IN_FLIGHT`` onwards, at most
    :data:`PARTS_IN_FLIGHT` of them. The same on every rank."""
    owned: List[List[_Part]] = [[] for _ in range(world_size)]
    for part in parts:
        owned[part.owner].append(part)
    count = max((-(-len(own) // PARTS_IN_FLIGHT) for own in owned), default=0)
    return [
        [part for own in owned for part in own[k * PARTS_IN_FLIGHT : (k + 1) * PARTS_IN_FLIGHT]] for k in range(count)
    ]


class _RoundExchange(NamedTuple):
    """One round of one rank: the bodies of the parts it uploads (its own bytes in place), the messages it sends to
    the owners of the other parts of the round, and those it receives from their holders. One message per part and
    holder, tagged with the part's number: a holder's one segment of a part is sent from its shard and received
    straight into its place in the body; several are sent together and received into a buffer (through ``device``'s
    buffers where that is not the CPU)."""

    own: List[_Part]
    bodies: Dict[int, torch.Tensor]
    outgoing: List[Tuple[int, int, torch.Tensor]]
    incoming: List[Tuple[int, int, List[torch.Tensor], torch.Tensor]]

    @classmethod
    def prepare(
        cls, rank: int, parts: List[_Part], sources: Dict[Any, torch.Tensor], fd: int, device: torch.device
    ) -> "_RoundExchange":
        """Allocate the round's bodies and buffers and copy this rank's own bytes: local work, which may fail (out of
        memory) before any rank enters the exchange."""
        own = [part for part in parts if part.owner == rank]
        bodies = {part.number: torch.empty(part.nbytes, dtype=torch.uint8) for part in own}
        outgoing, incoming = [], []
        for part in parts:
            by_holder: Dict[int, List[_Extent]] = {}
            for segment in part.segments:
                by_holder.setdefault(segment.rank, []).append(segment)
            if part.owner == rank:
                body = bodies[part.number]
                for holder, segments in by_holder.items():
                    places = [body[s.offset - part.offset :][: s.nbytes] for s in segments]
                    if holder == rank:
                        for place, segment in zip(places, segments):
                            _copy_segment(place, segment, sources, fd)
                        continue
                    direct = len(places) == 1 and device.type == "cpu"
                    buffer = places[0] if direct else torch.empty(sum(s.nbytes for s in segments), dtype=torch.uint8)
                    incoming.append((holder, part.number, [] if direct else places, buffer.to(device)))
            elif rank in by_holder:
                outgoing.append((part.owner, part.number, _message(by_holder[rank], sources, fd, device)))
        return cls(own, bodies, outgoing, incoming)

    def run(self, group: Optional[Any]) -> None:
        """Send and receive the round's messages over ``group``, and put what was received into place. Collective
        between the ranks that share a part."""
        sends = [(torch.distributed.isend, data, peer, tag) for peer, tag, data in self.outgoing]
        receives = [(torch.distributed.irecv, buffer, peer, tag) for peer, tag, _, buffer in self.incoming]
        if any(data.device.type != "cpu" for _, data, _, _ in sends + receives):
            # NCCL (no gloo group) runs a pair's sends and receives in order and ignores tags: two ranks that send
            # each other a part's bytes would each wait for the other's receive behind its own send
            ops = [torch.distributed.P2POp(op, data, peer, group, tag) for op, data, peer, tag in sends + receives]
            requests = torch.distributed.batch_isend_irecv(ops) if ops else []
        else:
            requests = [op(data, peer, group=group, tag=tag) for op, data, peer, tag in sends + receives]
        for request in requests:
            request.wait()
        for _, _, places, buffer in self.incoming:
            # ``places`` is empty where the message was received in place
            position = 0
            for place in places:
                place.copy_(buffer[position : position + place.numel()])
                position += place.numel()

    def parts(self) -> List[Tuple[int, torch.Tensor]]:
        """The round's parts of this rank: their offsets and bodies (the storage's extents)."""
        return [(part.offset, self.bodies[part.number]) for part in self.own]


def _message(segments: List[_Extent], sources: Dict[Any, torch.Tensor], fd: int, device: torch.device) -> torch.Tensor:
    """The bytes of ``segments`` (one part's bytes this rank holds) as one message on ``device``: a view of the shard
    where it is one segment of a shard there already, else a copy."""
    if len(segments) == 1 and segments[0].source is not None:
        segment = segments[0]
        data = sources[segment.source][segment.at : segment.at + segment.nbytes]
        return data if data.device == device else data.to(device)
    message = torch.empty(sum(s.nbytes for s in segments), dtype=torch.uint8)
    position = 0
    for segment in segments:
        _copy_segment(message[position : position + segment.nbytes], segment, sources, fd)
        position += segment.nbytes
    return message.to(device)


def _copy_segment(out: torch.Tensor, segment: _Extent, sources: Dict[Any, torch.Tensor], fd: int) -> None:
    """Copy the bytes of ``segment``, which this rank holds, into the byte tensor ``out``: from a source tensor, or
    from the scratch file (the structure, on global rank 0)."""
    if segment.source is not None:
        out.copy_(sources[segment.source][segment.at : segment.at + segment.nbytes])
        return
    view = _as_buffer(out)
    position = 0
    while position < segment.nbytes:
        read = os.preadv(fd, [view[position:]], segment.at + position)
        if read <= 0:
            raise EOFError(f"the scratch file ends before byte {segment.at + position}")
        position += read


def _gather_to_rank_zero(value: Any, world_size: int, group: Optional[Any]) -> List[Any]:
    """Every rank's ``value`` on global rank 0 (``[]`` on the others). Collective over ``group``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    is_zero = torch.distributed.get_rank() == 0
    gathered: Optional[List[Any]] = [None] * world_size if is_zero else None
    torch.distributed.gather_object(value, gathered, dst=0, group=group)
    return gathered or []
