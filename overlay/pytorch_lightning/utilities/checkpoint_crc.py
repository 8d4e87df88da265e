"""The CRC-32 of a checkpoint's zip records: computed by the processes that write a record's bytes as they write them,
combined without the data, and written into the record's data descriptor and central-directory entry.

``torch.save`` writes each record with flag bit 3 set: the local header's CRC-32 is 0, the real one (with the sizes) is
in a data descriptor right after the record's data (none for an empty record) and again in the record's entry of the
central directory at the end of the file. A streamed save writes the structure with ``torch.serialization.skip_data``,
which leaves the CRC-32 of every tensor record 0 in both places; :class:`_CrcLedger` and :func:`_write_record_crcs`
put the right values there once every byte is written.

The CRC-32 is ISA-L's (``isal``, about 20 GB/s with the carry-less multiply instructions of x86-64 and ARMv8, against
zlib's 2.5-4 GB/s here), which releases the GIL over large buffers and has ``crc32_combine``; CPython's ``zlib`` lacks
the latter before 3.13.

Used by :mod:`~pytorch_lightning.utilities.streamed_checkpoint_file`, the parallel save and the load's check
(:mod:`~pytorch_lightning.utilities.checkpoint_verification`).
"""
# fork-feature: fork/fsdp-streaming-save.patch
import bisect
import os
import struct
import zipfile
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from isal import isal_zlib

#: One piece of a record: ``nbytes`` bytes at ``offset`` of the file, and their CRC-32.
_Piece = Tuple[int, int, int]

_LOCAL_HEADER = struct.Struct("<4s22xHH")
_CENTRAL_HEADER = struct.Struct("<4s24xHHH12x")
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_LOCAL_SIGNATURE = b"PK\x03\x04"
#: the CRC-32's place in a data descriptor (after its signature) and in a central-directory entry
_DESCRIPTOR_CRC_AT = 4
_CENTRAL_CRC_AT = 16


def _crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of the buffer ``data``, continuing ``value``."""
    return isal_zlib.crc32(data, value)


def _crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of two buffers one after the other, from each one's CRC-32 and the second one's length."""
    return isal_zlib.crc32_combine(first, second, second_length)


class _ZipRecord(NamedTuple):
    """One record of a checkpoint's zip archive."""

    name: str
    #: where its data begins in the file, and its size
    offset: int
    size: int
    #: its CRC-32 as the central directory has it
    crc: int
    #: where its data descriptor begins (``None``: it has none) and where its central-directory entry begins
    descriptor: Optional[int]
    central: int

    @property
    def is_tensor(self) -> bool:
        """Whether it holds a tensor's storage (``archive/data/N``), which a streamed save writes later."""
        parts = self.name.split("/")  # ``<archive>/data/<key>``, whatever the archive's own name (``data`` too)
        return len(parts) == 3 and parts[1] == "data"


class _ZipIndex(NamedTuple):
    """Where the records of a checkpoint file lie, read from its central directory and local headers (the data is not
    read): :meth:`read`."""

    records: List[_ZipRecord]
    #: the central directory's offset, and its bytes up to the end of the file
    central_offset: int
    central: bytes

    @classmethod
    def read(cls, path: str) -> "_ZipIndex":
        """The index of the zip archive at ``path``.

        Raises:
            zipfile.BadZipFile: if it is not one, or its headers are inconsistent.
        """
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
            central_offset = archive.start_dir
            f.seek(central_offset)
            central = f.read()
            fd, records, at = f.fileno(), [], 0
            for info in infos:
                signature, name_length, extra_length, _ = _CENTRAL_HEADER.unpack_from(central, at)
                if signature != _CENTRAL_SIGNATURE:
                    raise zipfile.BadZipFile(f"the central directory of {path!r} is damaged at {info.filename!r}")
                local = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
                signature, local_name, local_extra = _LOCAL_HEADER.unpack(local)
                if signature != _LOCAL_SIGNATURE:
                    raise zipfile.BadZipFile(f"the local header of {info.filename!r} in {path!r} is damaged")
                offset = info.header_offset + _LOCAL_HEADER.size + local_name + local_extra
                has_descriptor = bool(info.flag_bits & 0x08) and info.file_size > 0
                records.append(
                    _ZipRecord(
                        info.filename,
                        offset,
                        info.file_size,
                        info.CRC,
                        offset + info.compress_size if has_descriptor else None,
                        central_offset + at,
                    )
                )
                comment_length = struct.unpack_from("<H", central, at + 32)[0]
                at += 46 + name_length + extra_length + comment_length
        return cls(records, central_offset, central)

    def unset_tensor_crcs(self) -> bool:
        """Whether every non-empty tensor record's CRC-32 is 0: written by a streamed or parallel save of fork
        revisions up to 110, or by ``torch.save`` with ``set_crc32_options(False)``."""
        tensors = [r for r in self.records if r.is_tensor and r.size > 0]
        return bool(tensors) and all(r.crc == 0 for r in tensors)

    def unset_crcs(self) -> bool:
        """Whether every non-empty record's CRC-32 is 0 (``torch.save`` with ``set_crc32_options(False)``)."""
        return all(r.crc == 0 for r in self.records if r.size > 0)


class _CrcLedger:
    """The CRC-32 of every piece of the file this process wrote, by offset, computed over each buffer as it is
    written (:meth:`note`, before the ``pwrite``): no second pass over the file."""

    def __init__(self) -> None:
        self.pieces: List[_Piece] = []

    def note(self, offset: int, data: Any) -> None:
        """Note the CRC-32 of ``data`` (a buffer), written at ``offset``."""
        size = memoryview(data).nbytes
        if size:
            self.pieces.append((offset, size, _crc32(data)))


def _record_crcs(index: _ZipIndex, pieces: Iterable[_Piece]) -> Dict[str, int]:
    """The CRC-32 of each tensor record of ``index``, combined from the ``pieces`` written into it (by any process).

    Raises:
        RuntimeError: if a piece lies outside the tensor records, or a record's pieces do not cover its bytes exactly
            once: a byte of it was not written (or twice), so its CRC-32 would be wrong.
    """
    records = sorted((r for r in index.records if r.is_tensor and r.size > 0), key=lambda r: r.offset)
    starts = [r.offset for r in records]
    by_record: Dict[int, List[_Piece]] = {}
    for piece in pieces:
        i = bisect.bisect_right(starts, piece[0]) - 1
        if i < 0 or piece[0] + piece[1] > records[i].offset + records[i].size:
            raise RuntimeError(f"{piece[1]} bytes were written at {piece[0]}, outside the tensor records of the file")
        by_record.setdefault(i, []).append(piece)
    crcs = {}
    for i, record in enumerate(records):
        crc = _tiled_crc(record.offset, record.size, by_record.get(i, []))
        if crc is None:
            raise RuntimeError(f"the record {record.name!r} of the checkpoint was not written exactly once, bytewise")
        crcs[record.name] = crc
    return crcs


def _tiled_crc(offset: int, size: int, pieces: List[_Piece]) -> Optional[int]:
    """The CRC-32 of the ``size`` bytes at ``offset``, from ``pieces`` that cover them exactly once; ``None`` where
    they do not."""
    crc, at = 0, offset
    for start, nbytes, piece_crc in sorted(pieces):
        if start != at:
            return None
        crc, at = _crc32_combine(crc, piece_crc, nbytes), at + nbytes
    return crc if at == offset + size else None


def _write_record_crcs(path: str, index: _ZipIndex, crcs: Dict[str, int]) -> None:
    """Write ``crcs`` (by record name) into the data descriptors and the central directory of the file at ``path``
    through a descriptor of its own, closed before it returns (NFS writes back on close; the caller's ``fsync`` of
    the file makes it durable, one sync where a sync uploads the file): where other processes wrote into the file,
    they have closed their descriptors, and this one sees what they wrote (close-to-open on NFS) without touching a
    byte beyond the CRC fields and the central directory."""
    central = bytearray(index.central)
    descriptor_writes = []
    for record in index.records:
        crc = crcs.get(record.name)
        if crc is None:
            continue
        struct.pack_into("<I", central, record.central - index.central_offset + _CENTRAL_CRC_AT, crc)
        if record.descriptor is not None:
            descriptor_writes.append((record.descriptor + _DESCRIPTOR_CRC_AT, struct.pack("<I", crc)))
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, data in descriptor_writes:
            os.pwrite(fd, data, offset)
        # the central directory without the end records after it, which hold no CRC
        end = max((r.central for r in index.records), default=index.central_offset) - index.central_offset
        if index.records:
            end += 46 + sum(struct.unpack_from("<HHH", central, end + 28))
        os.pwrite(fd, bytes(central[:end]), index.central_offset)
    finally:
        os.close(fd)
