"""A local, sparse copy of a checkpoint in object storage that holds only the byte ranges a process reads.

:class:`_SparseObjectCopy` makes a local scratch file of the object's size in which nothing is written yet (a hole,
no disk blocks), then fetches byte ranges into their places with its storage's ranged reads (``read_ranges`` of
:mod:`~pytorch_lightning.utilities.checkpoint_storage`: concurrent, never a readahead file object; on S3, ranged GETs
of one version of the object): first
the zip's structure (:meth:`fetch_structure`: the central directory, the local headers and every record that is not
a tensor's storage, so ``torch.load`` can read the file), then the tensor bytes this process reads (:meth:`fetch`).
Loaded with ``torch.load(mmap=True)``, the copy's tensors are backed by its pages; bytes never fetched read as
zeros, which is why the reader fetches every range it reads first, why the load's CRC-32 check raises where a read
range was not fetched (:meth:`missing`), and why it fetches a range it reads again only for that check
(:meth:`ensure`).

The scratch file is unlinked as soon as it is made: it lives while the copy's descriptor (:attr:`path` is
``/proc/self/fd/N``) or a mapping of it is open, so a killed process leaves nothing behind. Used by
:mod:`~pytorch_lightning.strategies.fsdp_ranged_load`.
"""
# fork-feature: fork/object-storage-checkpoints.patch
import bisect
import os
import tempfile
import zipfile
from typing import Iterable, List, Optional, Tuple

from fsspec import AbstractFileSystem

from pytorch_lightning.utilities.checkpoint_crc import _ZipIndex
from pytorch_lightning.utilities.checkpoint_storage import _CheckpointStorage
from pytorch_lightning.utilities.local_file_storage import _pwrite_all
from pytorch_lightning.utilities.multipart_upload import _is_multipart_store

#: The size of the longest ranged GET, and how many bytes one round of concurrent GETs holds in memory at most.
FETCH_BYTES = 16 * 2**20
ROUND_BYTES = 64 * 2**20
#: How much of the object's end is read first: the end of central directory record with the longest zip comment.
_TAIL_BYTES = 65536 + 22 + 20 + 56

_Range = Tuple[int, int]


class _SparseObjectCopy:
    """The sparse local copy of the ``size`` bytes of the checkpoint in ``storage`` (see the module's docstring; made
    for reading one version of it, see :meth:`version_of`).

    Args:
        storage: where the checkpoint is.
        size: its size.
        directory: where the scratch file is made (the system's temporary directory by default).
    """

    def __init__(self, storage: _CheckpointStorage, size: int, directory: Optional[str] = None) -> None:
        self.storage, self.url, self.size = storage, storage.url, size
        self._fd, scratch = tempfile.mkstemp(prefix="pl-checkpoint-", suffix=".ckpt", dir=directory)
        os.unlink(scratch)
        os.ftruncate(self._fd, self.size)
        #: the ranges fetched so far, sorted and disjoint
        self._fetched: List[_Range] = []
        #: the bytes fetched from the object, in all
        self.fetched_bytes = 0

    @staticmethod
    def version_of(fs: AbstractFileSystem, url: str) -> Tuple[int, Optional[str]]:
        """The size and ETag of the object at ``url``, asked of the store (not of a cached listing).

        Raises:
            FileNotFoundError: if there is no object at ``url`` (or it is a directory).
        """
        path = fs._strip_protocol(url)
        fs.invalidate_cache(path)
        info = fs.info(url)
        if info.get("type") == "directory" or info.get("size") is None:
            raise FileNotFoundError(url)
        etag = info.get("ETag") if _is_multipart_store(fs) else None
        return int(info["size"]), etag

    @property
    def path(self) -> str:
        """A path that opens the copy (while :meth:`close` was not called)."""
        return f"/proc/self/fd/{self._fd}"

    def fetch_structure(self) -> _ZipIndex:
        """Fetch what ``torch.load`` reads besides the tensors' data: the zip's central directory, every local header
        and every record that is not a tensor's storage (``data.pkl``, the version records); returns the index.

        Raises:
            zipfile.BadZipFile: if the object is not in torch's zip format.
        """
        self.fetch([(max(0, self.size - _TAIL_BYTES), self.size)])
        with zipfile.ZipFile(self.path) as archive:
            start = archive.start_dir
            infos = archive.infolist()
        self.fetch([(start, self.size)])
        # a local header is 30 bytes; its name and extra field follow, which the index does not read
        self.fetch((info.header_offset, min(self.size, info.header_offset + 30)) for info in infos)
        index = _ZipIndex.read(self.path)
        self.fetch((record.offset, record.offset + record.size) for record in index.records if not record.is_tensor)
        return index

    def fetch(self, ranges: Iterable[_Range]) -> None:
        """Fetch the byte ranges ``[start, end)`` not fetched yet, in ranged GETs of at most :data:`FETCH_BYTES`, each
        round of concurrent GETs holding at most :data:`ROUND_BYTES`."""
        wanted = [piece for start, end in _merged(ranges) for piece in self._missing(start, end)]
        pieces = [(lo, min(lo + FETCH_BYTES, end)) for start, end in wanted for lo in range(start, end, FETCH_BYTES)]
        round_: List[_Range] = []
        for piece in pieces:
            if round_ and sum(end - start for start, end in round_) + piece[1] - piece[0] > ROUND_BYTES:
                self._fetch_round(round_)
                round_ = []
            round_.append(piece)
        if round_:
            self._fetch_round(round_)
        self._fetched = _merged(self._fetched + wanted)

    def ensure(self, offset: int, size: int) -> None:
        """Fetch whatever of ``size`` bytes at ``offset`` is not fetched yet (the check reads it from the copy)."""
        self.fetch([(offset, offset + size)])

    def missing(self, offset: int, size: int) -> bool:
        """Whether some of ``size`` bytes at ``offset`` were never fetched (they read as zeros)."""
        return bool(self._missing(offset, offset + size))

    def close(self) -> None:
        """Close the copy's descriptor; its mappings (the loaded tensors) stay valid."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _missing(self, start: int, end: int) -> List[_Range]:
        missing, position = [], start
        i = max(bisect.bisect_right(self._fetched, (start, start)) - 1, 0)
        for lo, hi in self._fetched[i:]:
            if lo >= end:
                break
            if hi <= position:
                continue
            if lo > position:
                missing.append((position, lo))
            position = max(position, hi)
        if position < end:
            missing.append((position, end))
        return missing

    def _fetch_round(self, pieces: List[_Range]) -> None:
        for (start, end), chunk in zip(pieces, self.storage.read_ranges(pieces)):
            self.fetched_bytes += _pwrite_all(self._fd, chunk, start)


def _merged(ranges: Iterable[_Range]) -> List[_Range]:
    """``ranges`` sorted, without empty ones, those that overlap or touch merged."""
    merged: List[_Range] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
