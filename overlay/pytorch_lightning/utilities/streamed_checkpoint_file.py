"""The streamed checkpoint file: a local checkpoint written in two steps, its structure first and the values of its
pending tensors later, as the FSDP units they belong to are gathered one at a time.

Used by :mod:`~pytorch_lightning.strategies.fsdp_streaming_save`; the file is made,
committed and discarded as :func:`~pytorch_lightning.utilities.atomic_save.save_atomically` does.
"""
# fork-feature: fork/fsdp-streaming-save.patch
import inspect
import os
from contextlib import nullcontext
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from pytorch_lightning.utilities.atomic_save import _create_temporary_file, remove_stale_temporary_files
from pytorch_lightning.utilities.checkpoint_crc import (
    _CrcLedger,
    _Piece,
    _record_crcs,
    _write_record_crcs,
    _ZipIndex,
)
from pytorch_lightning.utilities.checkpoint_flush import _chunk_fsync_policy, _log_chunk_fsync_policy, _mount_of
from pytorch_lightning.utilities.checkpoint_storage import _CheckpointStorage
from pytorch_lightning.utilities.local_file_storage import (
    _LocalFileStorage,
    _LocalFileWriter,
    _memory_of,
    _remove_quietly,
    FLUSH_BYTES,
)
from pytorch_lightning.utilities.safe_load import loading_own_file, safe_load
from pytorch_lightning.utilities.types import _PATH


def _streamed_save_available() -> bool:
    """Whether this torch can write a checkpoint's structure before its data (``skip_data`` with FakeTensors,
    torch >= 2.5), which :class:`_StreamedCheckpointFile` needs."""
    skip_data = getattr(torch.serialization, "skip_data", None)
    return skip_data is not None and "materialize_fake_tensors" in inspect.signature(skip_data).parameters


class _NotStreamable(Exception):
    """The checkpoint cannot be written by :class:`_StreamedCheckpointFile`, and is saved whole instead."""


class _StreamedCheckpointFile:
    """A local checkpoint file written in two steps: its structure first, the values of its *pending* tensors
    later, as they become available, so that they never need to be in memory all at once.

    Pending tensors are placeholders (``FakeTensor``\\ s, which have a shape and a dtype but no data) in the
    checkpoint dict. :meth:`write_skeleton` saves the dict with :func:`torch.save` under
    ``torch.serialization.skip_data``, which reserves the space of every tensor without writing it, then writes the
    data of every other tensor right away; :meth:`write` puts the values of a pending tensor (or a part of them) in
    place with ``pwrite``. The result is the file ``torch.save`` writes, CRC-32 fields included: the CRC-32 of every
    piece is computed as it is written (here, or by the other ranks of a parallel save, see :meth:`add_crcs`), and
    :meth:`commit` combines them per record and writes them into the records' data descriptors and central-directory
    entries (see :mod:`~pytorch_lightning.utilities.checkpoint_crc`).

    As with :func:`~pytorch_lightning.utilities.cloud_io.atomic_save`, everything is written into a new temporary file
    in the destination directory, the staged file of its :attr:`storage` (a
    :class:`~pytorch_lightning.utilities.local_file_storage._LocalFileStorage`): :meth:`commit` has the storage
    ``fsync`` it and rename it over ``path``; :meth:`discard` removes it, leaving any earlier file at ``path``
    untouched. Written data is flushed to disk every ``flush_bytes`` and dropped from the page cache, so that a
    memory-limited container is not charged for the whole file.

    Where an ``fsync`` uploads the file or waits on a server (FUSE mounts of object stores, NFS, Lustre: see
    :mod:`~pytorch_lightning.utilities.checkpoint_flush`; ``PL_CHECKPOINT_CHUNK_FSYNC`` overrides the choice), the
    chunks are not ``fdatasync``-ed, only the whole file in :meth:`commit`. Each flush point still calls
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the whole file; on Linux that starts writeback of its dirty pages
    without waiting for it (``WB_SYNC_NONE``) and drops those already written back, while the kernel's dirty limits
    throttle the writer before the rest pile up, so the page cache stays bounded without waiting for the server.
    The file is written through a :class:`~pytorch_lightning.utilities.local_file_storage._LocalFileWriter`, as the
    other ranks of a parallel save write theirs.

    A checkpoint for object storage is built in a local scratch file instead (``directory``), whose structure the
    processes upload with their data (see :mod:`~pytorch_lightning.strategies.fsdp_parallel_upload`): torch writes a
    skipped tensor's bytes as a hole, so the file takes the room of the structure only. Its :attr:`storage` is set
    once the save knows it (see :mod:`~pytorch_lightning.utilities.checkpoint_storage`): :meth:`commit` then uploads
    or copies the file instead of the rename, and :meth:`discard` aborts the upload.

    Args:
        path: the local path the checkpoint is saved to (with ``directory``, its URL).
        flush_bytes: how many bytes to write between flushes.
        directory: the local directory of the scratch file, where the checkpoint goes elsewhere.
    """

    def __init__(self, path: _PATH, flush_bytes: int = FLUSH_BYTES, directory: Optional[str] = None) -> None:
        if directory is None:
            # Write through a symlink to its target, as ``atomic_save`` does.
            self.path = os.path.realpath(str(path))
            self._dirname = os.path.dirname(self.path)
        else:
            self.path, self._dirname = str(path), directory
        self._crcs_written = False
        # decided before the temporary file is made, which an invalid `PL_CHECKPOINT_CHUNK_FSYNC` would leave behind
        #: the mount the file is on (``None`` where the mount table cannot be read), read once per file
        self.mount = _mount_of(self._dirname)
        policy = _chunk_fsync_policy(self._dirname, self.mount)
        _log_chunk_fsync_policy(policy, flush_bytes)
        os.makedirs(self._dirname, exist_ok=True)
        remove_stale_temporary_files(self._dirname)
        self.tmp_path, self._fd = _create_temporary_file(self._dirname, os.path.basename(self.path))
        #: where the file goes when it is committed: the local file at ``path``, or (a scratch file) set once known
        self.storage: Optional[_CheckpointStorage] = (
            _LocalFileStorage(self.path, self.tmp_path) if directory is None else None
        )
        #: what the storage's commit needs of every rank's writes (see ``_CheckpointStorage.write``)
        self.receipts: List[Any] = []
        self._offsets: Dict[int, int] = {}
        #: the CRC-32 of every piece written into the file, here and (:meth:`add_crcs`) by other processes
        self._crcs = _CrcLedger()
        self._out = _LocalFileWriter(self._fd, policy.fsync_chunks, flush_bytes, self._crcs, whole_file=True)
        #: where the file's records lie, once :meth:`write_skeleton` wrote them
        self.index: Optional[_ZipIndex] = None
        #: set by the writer once every value is written: leaving the ``with`` block then commits the file
        self.complete = False
        self.committed = False

    def __enter__(self) -> "_StreamedCheckpointFile":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool:
        """Commit the file if the block marked it :attr:`complete` and raised nothing, else discard it."""
        if exc_type is None and self.complete:
            self.commit()
        else:
            self.discard()
        return False

    def write_skeleton(self, checkpoint: Dict[str, Any], pending: List[torch.Tensor]) -> None:
        """Save ``checkpoint``, leaving room for the values of the ``pending`` tensors. What it writes is flushed
        with the values that follow, every ``flush_bytes`` (an asynchronous save writes the skeleton in the training
        thread, which should not wait for the disk).

        Raises:
            _NotStreamable: if a pending tensor is not in ``checkpoint``, or a tensor is out of reach (inside an
                object other than a dict, list or tuple), so its data could not be written.
        """
        skip_data = torch.serialization.skip_data(materialize_fake_tensors=True)
        with os.fdopen(self._fd, "wb", closefd=False) as f, skip_data:
            torch.save(checkpoint, f)
        # Loaded onto the meta device, the skeleton's storages tell where their data lies in the file. It is this
        # process's own file, unpickled fully (it holds whatever the checkpoint holds), so it is read through a
        # descriptor of the very file written above, never one put in its place.
        try:
            with open(self.tmp_path, "rb") as f, loading_own_file(self.tmp_path):
                if not os.path.samestat(os.fstat(f.fileno()), os.fstat(self._fd)):
                    raise RuntimeError(f"{self.tmp_path!r} was replaced while it was being written")
                skeleton = safe_load(torch.load, self.tmp_path, f, map_location="meta")
        except Exception as ex:
            # e.g. ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` and hyperparameters that are not allowlisted
            raise _NotStreamable(f"the file's structure cannot be read back ({type(ex).__name__}: {ex})") from ex
        pending_keys = {t.untyped_storage()._cdata for t in pending}
        written = set()
        for tensor, reserved in _paired_tensors(checkpoint, skeleton):
            offset = getattr(reserved.untyped_storage(), "_checkpoint_offset", None)
            if offset is None:
                raise _NotStreamable("this torch does not report where a tensor's data lies in the file")
            key = tensor.untyped_storage()._cdata
            self._offsets[key] = offset
            if key not in pending_keys and offset not in written:
                storage = tensor.untyped_storage().cpu()
                self._out.write_buffer(_memory_of(storage.data_ptr(), storage.nbytes()), offset, flush=False)
            written.add(offset)
        self.index = _ZipIndex.read(self.tmp_path)
        records = sum(1 for record in self.index.records if record.is_tensor)
        if len(written) != records or not pending_keys <= set(self._offsets):
            raise _NotStreamable("some tensors of the checkpoint are not in a dict, list or tuple")
        self._out.flush_if_due()

    def write(self, placeholder: torch.Tensor, values: torch.Tensor, element_offset: int = 0) -> None:
        """Write ``values`` into the storage of the pending tensor ``placeholder``, starting at its element
        ``element_offset``."""
        values = values.detach().cpu().contiguous()
        offset = self.offset_of(placeholder) + element_offset * placeholder.element_size()
        self._out.write_buffer(_memory_of(values.data_ptr(), values.numel() * values.element_size()), offset)

    def write_shards(
        self,
        placeholder: torch.Tensor,
        shards: List[torch.Tensor],
        numel: int,
        start: int = 0,
        end: Optional[int] = None,
    ) -> None:
        """Write the elements ``start`` to ``end`` (by default all) of a flat tensor of ``numel`` elements, given as
        every rank's shard of it, into the pending tensor ``placeholder``, whose first element is element ``start``;
        straight from the shards, without putting the flat tensor together."""
        end = numel if end is None else end
        for shard, (lo, hi) in zip(shards, _valid_ranges(shards, numel)):
            first, last = max(start, lo), min(end, hi)
            if first < last:
                self.write(placeholder, shard[first - lo : last - lo], element_offset=first - start)

    def offset_of(self, placeholder: torch.Tensor) -> int:
        """Where the data of the pending tensor ``placeholder`` lies in the file, once :meth:`write_skeleton` ran."""
        return self._offsets[placeholder.untyped_storage()._cdata]

    def fileno(self) -> int:
        return self._fd

    def add_crcs(self, pieces: List[_Piece]) -> None:
        """Add the CRC-32 of ``pieces`` another process wrote into the file (see
        :class:`~pytorch_lightning.utilities.checkpoint_crc._CrcLedger`)."""
        self._crcs.pieces.extend(pieces)

    def flush(self) -> None:
        """Write the data written since the last flush to disk (or, without chunk ``fsync``-s, start writing it) and
        drop it from the page cache."""
        self._out.flush()

    def commit(self) -> None:
        """Write the CRC-32 of every record (every byte of it must have been written, here or by the processes whose
        pieces :meth:`add_crcs` added), then have the :attr:`storage` commit the file with :attr:`receipts` (a local
        file: made durable and renamed over ``path``)."""
        storage = self.storage
        try:
            self.write_crcs()
            if storage is None:
                raise RuntimeError(f"the scratch file of {self.path!r} was given nowhere to go")
            self._close()
            storage.commit(self.receipts)
        except BaseException:
            self.discard()
            raise
        self.storage = None
        self.committed = True

    def write_crcs(self) -> None:
        """Write the CRC-32 of every record into the file's data descriptors and central directory, once (see
        :meth:`commit`): before its structure is uploaded, where the file is a scratch file."""
        if self.index is not None and not self._crcs_written:
            _write_record_crcs(self.tmp_path, self.index, _record_crcs(self.index, self._crcs.pieces))
            self._crcs_written = True

    def discard(self) -> None:
        """Have the :attr:`storage` discard the save (remove the temporary file, abort an upload); the file at
        ``path``, if any, is left as it was. Nothing once the file is committed."""
        storage, self.storage = self.storage, None
        try:
            self._close()
        finally:
            if storage is not None:
                storage.discard()
            elif not self.committed:
                # a scratch file given nowhere to go yet
                _remove_quietly(self.tmp_path)

    def _close(self) -> None:
        # marked closed first: a ``close`` that reports an error (NFS, FUSE: a delayed write error) has released the
        # descriptor, whose number another thread may have been given by the time a ``discard`` follows
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _committed_if_complete(writer: Optional[_StreamedCheckpointFile]) -> ContextManager[Any]:
    """``writer`` as a context manager that commits or discards it (see :meth:`_StreamedCheckpointFile.__exit__`);
    nothing on the ranks without a file."""
    return writer if writer is not None else nullcontext()


def _valid_ranges(shards: List[torch.Tensor], numel: int) -> List[Tuple[int, int]]:
    """For each rank's shard of a flat tensor of ``numel`` elements, the range of the flat tensor it holds (FSDP pads
    the last shards with zeros)."""
    chunk = shards[0].numel()
    return [(min(rank * chunk, numel), min((rank + 1) * chunk, numel)) for rank in range(len(shards))]


def _paired_tensors(obj: Any, twin: Any) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """The tensors of ``obj`` with those at the same place in ``twin``, a copy of ``obj``; only dicts, lists and
    tuples are looked into."""
    if isinstance(obj, torch.Tensor):
        yield obj, twin
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paired_tensors(value, twin[key])
    elif isinstance(obj, (list, tuple)):
        for value, value_twin in zip(obj, twin):
            yield from _paired_tensors(value, value_twin)
