"""The records of a ``torch.save`` zip archive and their CRC-32 fields, read with ``struct`` and :mod:`zipfile` only,
independently of the fork's own reader (``pytorch_lightning.utilities.checkpoint_crc._ZipIndex``), so that tests can
check what the fork writes there.

``torch.save`` writes every record stored (not compressed) with flag bit 3 set: the local header's CRC-32 and sizes
are 0, and the real ones follow the record's data in a data descriptor (``PK\\x07\\x08``, CRC-32, compressed size,
uncompressed size: 16 bytes; 24, with 8-byte sizes, where the local header has a zip64 extra field, which miniz writes
with it for a record past 4 GiB). An empty record has no descriptor. The central directory has the CRC-32 and the
sizes again. :func:`record_problems` checks all of them against the record's bytes: what ``unzip -t`` checks, and
more.
"""
import shutil
import struct
import subprocess
import zipfile
import zlib
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

#: signature, version needed, flags, method, time, date, CRC-32, compressed and uncompressed sizes, name and extra
#: lengths
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
LOCAL_SIGNATURE = b"PK\x03\x04"
CENTRAL_SIGNATURE = b"PK\x01\x02"
DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
#: signature, CRC-32, compressed size, uncompressed size; with 8-byte sizes under zip64
DESCRIPTOR = struct.Struct("<4sIII")
DESCRIPTOR64 = struct.Struct("<4sIQQ")
ZIP64_EXTRA_ID = 0x0001


class Descriptor(NamedTuple):
    """A record's data descriptor, as read at ``offset`` (``length`` bytes)."""

    offset: int
    length: int
    signature: bytes
    crc: int
    compressed_size: int
    size: int


class Record(NamedTuple):
    """One record of the archive: where its data lies, the CRC-32 of those bytes, and its CRC-32 fields."""

    name: str
    header_offset: int
    flags: int
    method: int
    #: the name in its local header, where its data begins and its size (the central directory's)
    local_name: str
    offset: int
    size: int
    #: ``zlib.crc32`` of the ``size`` bytes at ``offset``
    crc: int
    central_crc: int
    #: ``None``: the local header's flag bit 3 is not set or the record is empty, so none is read
    descriptor: Optional[Descriptor]

    @property
    def end(self) -> int:
        """Where the record ends: after its descriptor, if it has one."""
        return self.offset + self.size + (self.descriptor.length if self.descriptor else 0)

    @property
    def is_tensor(self) -> bool:
        """Whether it is a tensor's storage: ``<archive>/data/<key>``."""
        parts = self.name.split("/")
        return len(parts) == 3 and parts[1] == "data"


def _has_zip64_extra(extra: bytes) -> bool:
    at = 0
    while at + 4 <= len(extra):
        header_id, length = struct.unpack_from("<HH", extra, at)
        if header_id == ZIP64_EXTRA_ID:
            return True
        at += 4 + length
    return False


def read_records(path: Path) -> Tuple[List[Record], int]:
    """The records of the archive at ``path`` in the order of their local headers, and where its central directory
    begins. The central directory is read by :mod:`zipfile`; local headers and descriptors with ``struct``."""
    data = Path(path).read_bytes()
    with zipfile.ZipFile(path) as archive:
        infos, central_offset = archive.infolist(), archive.start_dir
    records = []
    for info in sorted(infos, key=lambda info: info.header_offset):
        at = info.header_offset
        signature, _, flags, method, _, _, _, _, _, name_length, extra_length = LOCAL_HEADER.unpack_from(data, at)
        assert signature == LOCAL_SIGNATURE, f"{info.filename}: no local header at {at}"
        name_at = at + LOCAL_HEADER.size
        local_name = data[name_at : name_at + name_length].decode("utf-8")
        extra = data[name_at + name_length : name_at + name_length + extra_length]
        offset = name_at + name_length + extra_length
        size = info.file_size
        descriptor = None
        if flags & 0x08 and size > 0:
            layout = DESCRIPTOR64 if _has_zip64_extra(extra) else DESCRIPTOR
            descriptor = Descriptor(offset + size, layout.size, *layout.unpack_from(data, offset + size))
        crc = zlib.crc32(data[offset : offset + size])
        records.append(
            Record(info.filename, at, flags, method, local_name, offset, size, crc, info.CRC, descriptor)
        )
    return records, central_offset


def record_problems(path: Path) -> List[str]:
    """What is wrong with the CRC-32 fields of the records of the archive at ``path`` (nothing: ``[]``): for every
    record, stored uncompressed, the central directory's CRC-32 must be that of its bytes; a non-empty record must have
    a data descriptor right after its data with its signature, that CRC-32 and its size twice, and the next record's
    local header (or the central directory) must begin right after it."""
    records, central_offset = read_records(path)
    problems = []
    for record, following in zip(records, [r.header_offset for r in records[1:]] + [central_offset]):
        name = record.name
        if record.local_name != name or record.method != zipfile.ZIP_STORED:
            problems.append(f"{name}: local header name {record.local_name!r}, method {record.method}")
        if record.central_crc != record.crc:
            problems.append(f"{name}: central directory CRC-32 {record.central_crc:#010x} != {record.crc:#010x}")
        descriptor = record.descriptor
        if record.size > 0 and descriptor is None:
            problems.append(f"{name}: no data descriptor (flags {record.flags:#x})")
        elif descriptor is not None:
            if descriptor.signature != DESCRIPTOR_SIGNATURE:
                problems.append(f"{name}: descriptor signature {descriptor.signature!r} at {descriptor.offset}")
            if descriptor.crc != record.crc:
                problems.append(f"{name}: descriptor CRC-32 {descriptor.crc:#010x} != {record.crc:#010x}")
            if (descriptor.compressed_size, descriptor.size) != (record.size, record.size):
                problems.append(f"{name}: descriptor sizes {descriptor[4:]} != {record.size}")
        if record.end != following:
            problems.append(f"{name}: ends at {record.end}, the next header begins at {following}")
    return problems


def unzip_test(path: Path) -> Optional[subprocess.CompletedProcess]:
    """``unzip -t`` of the archive at ``path`` (``None`` where ``unzip`` is not installed)."""
    unzip = shutil.which("unzip")
    if unzip is None:
        return None
    return subprocess.run([unzip, "-t", str(path)], capture_output=True, text=True, timeout=60)
