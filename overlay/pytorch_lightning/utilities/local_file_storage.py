"""Checkpoints in local files (anything mounted, NFS and Lustre included): the storage of
:mod:`~pytorch_lightning.utilities.checkpoint_storage` whose staged file is the temporary file beside the checkpoint.

Every rank writes its byte ranges into the temporary file in place with ``pwrite`` (:class:`_LocalFileWriter`, which
global rank 0's streamed checkpoint file writes through too), and the commit renames the file over the checkpoint.
"""
# fork-feature: fork/object-storage-checkpoints.patch
import ctypes
import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from typing_extensions import override

from pytorch_lightning.utilities.atomic_save import _fsync_directory
from pytorch_lightning.utilities.checkpoint_crc import _CrcLedger
from pytorch_lightning.utilities.checkpoint_storage import _CheckpointStorage, _Extent, _Range, _whole_ranges

#: The pinned host buffer through which a rank writes its GPU shards.
STAGING_BYTES = 8 * 2**20
#: How many bytes a writer writes between flushes.
FLUSH_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _LocalFileStorage(_CheckpointStorage):
    """The checkpoint at ``url``, a local path, staged in the temporary file ``staged`` beside it.

    Args:
        url: the checkpoint's path.
        staged: the temporary file global rank 0 made.
        fsync_chunks: whether a writer ``fdatasync``-s at every flush (see ``_chunk_fsync_policy``); each rank sets
            its own, for its own mount of the directory.
        flush_bytes: how many bytes a writer writes between flushes.
    """

    url: str
    staged: str
    fsync_chunks: bool = False
    flush_bytes: int = FLUSH_BYTES

    @override
    def write(self, extents: Iterable[_Extent], crcs: Optional[_CrcLedger] = None) -> List[Any]:
        """Write ``extents`` into the staged file through a descriptor of this rank's own (``O_WRONLY``, no
        truncation), then ``fdatasync`` and close it; returns no receipts (the commit renames the file)."""
        if not self.staged:
            raise ValueError(f"The storage of {self.url!r} was made for reading only.")
        fd = os.open(self.staged, os.O_WRONLY)
        try:
            writer = _LocalFileWriter(fd, self.fsync_chunks, self.flush_bytes, crcs)
            for offset, data in extents:
                writer.write(data, offset)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return []

    @override
    def commit(self, receipts: Sequence[Any]) -> None:
        """``fsync`` the staged file (its data, whichever descriptors wrote it), rename it over the checkpoint and
        ``fsync`` the directory."""
        # through a new descriptor: the writers' are closed. Linux (>= 4.16) reports a writeback error that no
        # descriptor has seen yet to the next ``fsync`` of any descriptor, this one's too; those the writers saw were
        # raised by their own ``fdatasync``
        _fsync_file(self.staged)
        os.replace(self.staged, self.url)
        _fsync_directory(os.path.dirname(self.url))

    @override
    def discard(self) -> None:
        _remove_quietly(self.staged)

    @override
    def read_ranges(self, ranges: Sequence[_Range]) -> List[bytes]:
        """The bytes of ``ranges`` of the checkpoint, with ``pread``. (A load maps the file instead, see
        ``mmap_load``: the pages it touches are its ranged reads.)"""
        with open(self.url, "rb") as f:
            return _whole_ranges(self.url, ranges, [os.pread(f.fileno(), end - start, start) for start, end in ranges])


class _LocalFileWriter:
    """Writes byte ranges of flat byte tensors at given offsets of the open file ``fd``: CPU memory directly, GPU
    memory through one reused pinned buffer; notes every piece's CRC-32 in ``crcs`` (where given) as it writes it, and
    every ``flush_bytes`` flushes (see :func:`_flush_written`). A rank of a parallel save flushes the span it wrote
    into since the last flush, not the whole file: every rank writes into the one file, each rank's shards lying
    between the others', and advising the whole file at every rank's every flush walks every rank's share of it each
    time. The only writer of a file (``whole_file``) advises all of it: chunks whose writeback was still running at
    their own flush are dropped at a later one.

    Args:
        fd: the file, open for writing.
        fsync_chunks: whether to ``fdatasync`` at every flush (see ``_chunk_fsync_policy``).
        flush_bytes: how many bytes to write between flushes.
        crcs: where the CRC-32 of every piece written is noted.
        whole_file: whether a flush drops the whole file from the page cache (the file's only writer).
    """

    def __init__(
        self,
        fd: int,
        fsync_chunks: bool,
        flush_bytes: int = FLUSH_BYTES,
        crcs: Optional[_CrcLedger] = None,
        whole_file: bool = False,
    ) -> None:
        self._fd, self._fsync_chunks, self._flush_bytes, self._crcs = fd, fsync_chunks, flush_bytes, crcs
        self._whole_file = whole_file
        #: how many bytes were written since the last flush
        self.unflushed = 0
        #: the byte range of the file written since the last flush
        self._written: Optional[Tuple[int, int]] = None
        self._staging: Optional[torch.Tensor] = None

    def write(self, data: torch.Tensor, offset: int) -> None:
        """Write the flat byte tensor ``data`` at ``offset``, in steps of at most ``flush_bytes`` (or the staging
        buffer)."""
        on_cpu = data.device.type == "cpu"
        step = self._flush_bytes if on_cpu else self._staging_buffer().numel()
        nbytes = data.numel()
        for start in range(0, nbytes, step):
            size = min(step, nbytes - start)
            if on_cpu:
                view = _memory_of(data.data_ptr() + start, size)
            else:
                staging = self._staging_buffer()
                staging[:size].copy_(data[start : start + size])
                view = _memory_of(staging.data_ptr(), size)
            self.write_buffer(view, offset + start)

    def write_buffer(self, view: Any, offset: int, flush: bool = True) -> None:
        """Write the buffer ``view`` at ``offset``, flushing once ``flush_bytes`` are written since the last flush
        (unless ``flush`` is false: the caller flushes later)."""
        if self._crcs is not None:
            self._crcs.note(offset, view)
        size = _pwrite_all(self._fd, view, offset)
        lo, hi = self._written or (offset, offset)
        self._written = (min(lo, offset), max(hi, offset + size))
        self.unflushed += size
        if flush:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        """Flush once ``flush_bytes`` are written since the last flush."""
        if self.unflushed >= self._flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Write what was written since the last flush to disk (or start writing it) and drop it (``whole_file``: the
        whole file) from the page cache."""
        if self._whole_file:
            _flush_written(self._fd, self._fsync_chunks)
        elif self._written is not None:
            lo, hi = self._written
            _flush_written(self._fd, self._fsync_chunks, lo, hi - lo)
        self.unflushed, self._written = 0, None

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        return self._staging


def _pwrite_all(fd: int, data: Any, offset: int) -> int:
    """Write all of ``data`` (a buffer) at ``offset`` of the file ``fd`` (``pwrite`` may write less than asked);
    returns its size in bytes."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return size


def _fsync_file(path: str) -> None:
    """``fsync`` the file at ``path`` through a descriptor of its own."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flush_written(fd: int, fsync_chunks: bool, offset: int = 0, length: int = 0) -> None:
    """Write what was written to ``fd`` to disk (``fsync_chunks``), or start writing it, and drop what is written
    from the page cache, of the whole file or of ``length`` bytes at ``offset``; see ``_StreamedCheckpointFile``."""
    if fsync_chunks:
        os.fdatasync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _memory_of(address: int, size: int) -> memoryview:
    """The ``size`` bytes of CPU memory at ``address``, without a copy. Unlike ``Tensor.numpy()``, this leaves the
    tensor's storage resizable, which FSDP needs to free its gathered parameters."""
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _remove_quietly(path: Optional[str]) -> None:
    """Remove ``path`` (if any); gone already is fine, and a failure leaves a temporary file that the stale-file rule
    removes later (the save's own outcome is what the caller reports)."""
    if path is None:
        return
    try:
        os.remove(path)
    except OSError:
        pass
