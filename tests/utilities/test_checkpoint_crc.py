"""The CRC-32 bookkeeping of streamed and parallel saves (``pytorch_lightning/utilities/checkpoint_crc.py``), without
a save: the processes that write a record's bytes each note the CRC-32 of their pieces, global rank 0 combines them
per record without the data and writes the results into the records' data descriptors and central-directory
entries.

So the combination must equal ``zlib.crc32`` of the whole record for any split (empty pieces included); a record
whose pieces leave a gap or overlap, or a piece outside the tensor records, must raise rather than give a wrong
CRC-32; :class:`_ZipIndex` must find every record's data, descriptor and central entry where ``torch.save`` put them
(checked here with ``struct`` on the file's bytes, not with the reader under test); and writing the CRC-32s into a
file whose fields a streamed save left 0 must give back ``torch.save``'s file byte for byte.
"""
import random
import struct
import zipfile
import zlib
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from pytorch_lightning.utilities.checkpoint_crc import (
    _crc32,
    _crc32_combine,
    _CrcLedger,
    _record_crcs,
    _write_record_crcs,
    _ZipIndex,
)
from tests.helpers.zip_records import (
    CENTRAL_SIGNATURE,
    DESCRIPTOR,
    DESCRIPTOR_SIGNATURE,
    LOCAL_SIGNATURE,
    read_records,
)

#: where the CRC-32 lies in a data descriptor and in a central-directory entry (APPNOTE 4.3.9, 4.3.12)
DESCRIPTOR_CRC_AT, CENTRAL_CRC_AT = 4, 16


def _split(rng: random.Random, size: int, pieces: int) -> List[Tuple[int, int]]:
    """``pieces`` consecutive ranges ``(start, end)`` covering ``range(size)``; some may be empty."""
    cuts = sorted(rng.randint(0, size) for _ in range(pieces - 1))
    bounds = [0, *cuts, size]
    return list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("seed", range(8))
def test_combine_equals_crc_of_the_whole_buffer(seed):
    """Random buffers cut at random places, empty pieces included, combined piece by piece from the left: the
    result is ``zlib.crc32`` of the whole buffer; so is ``_crc32`` of it, and of its pieces continued."""
    rng = random.Random(seed)
    data = rng.randbytes(rng.choice([0, 1, 7, 4096, 100_003]))
    expected = zlib.crc32(data)
    assert _crc32(data) == expected
    for pieces in (1, 2, 3, 17):
        ranges = _split(rng, len(data), pieces)
        crc, continued = 0, 0
        for start, end in ranges:
            crc = _crc32_combine(crc, zlib.crc32(data[start:end]), end - start)
            continued = _crc32(data[start:end], continued)
        assert (crc, continued) == (expected, expected), (len(data), ranges)


def test_combine_with_empty_pieces_and_chained_groups():
    """An empty piece changes nothing on either side; groups of pieces combined on their own (as one rank's pieces
    of a record may be) and then with each other give the whole buffer's CRC-32."""
    rng = random.Random(1)
    data = rng.randbytes(10_000)
    whole = zlib.crc32(data)
    assert _crc32_combine(whole, zlib.crc32(b""), 0) == whole
    assert _crc32_combine(zlib.crc32(b""), whole, len(data)) == whole
    ranges = _split(rng, len(data), 12)
    groups = [ranges[:5], ranges[5:9], ranges[9:]]
    combined, length = 0, 0
    for group in groups:
        group_crc, group_length = 0, 0
        for start, end in group:
            group_crc = _crc32_combine(group_crc, zlib.crc32(data[start:end]), end - start)
            group_length += end - start
        combined = _crc32_combine(combined, group_crc, group_length)
        length += group_length
    assert (combined, length) == (whole, len(data))


def _save(path: Path, as_buffer: bool = True) -> None:
    """A checkpoint with tensors of several sizes, an empty one and a shared storage; saved through a file object
    (the archive is then called ``archive``, as in a streamed save) or to the path."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(72, 72, generator=generator)
    checkpoint = {
        "state_dict": {"weight": weight, "tied": weight, "bias": torch.randn(72, generator=generator)},
        "empty": torch.empty(0),
        "steps": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(3.0),
        "epoch": 2,
    }
    if as_buffer:
        with open(path, "wb") as f:
            torch.save(checkpoint, f)
    else:
        torch.save(checkpoint, path)


@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "path"])
def test_index_finds_every_record_and_its_crc_fields(tmp_path, as_buffer):
    """For every record of a ``torch.save`` file: the bytes at ``offset:offset + size`` have the central directory's
    CRC-32; a non-empty record's descriptor is right after them (signature, that CRC-32, the size twice, then the
    next local header or the central directory); an empty one has none; ``central`` is its central-directory entry,
    which holds the same CRC-32."""
    path = tmp_path / "checkpoint.ckpt"
    _save(path, as_buffer)
    data = path.read_bytes()
    index = _ZipIndex.read(str(path))
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename: info for info in archive.infolist()}
        assert index.central_offset == archive.start_dir
    assert [record.name for record in index.records] == list(infos)
    assert index.central == data[index.central_offset :]
    headers = sorted(info.header_offset for info in infos.values()) + [index.central_offset]
    tensors = [record for record in index.records if record.is_tensor]
    assert sorted(record.size for record in tensors) == [0, 4, 40, 72 * 4, 72 * 72 * 4]
    # the same places as the test's own reader finds (which reads a zip64 descriptor's 8-byte sizes too)
    found = {r.name: (r.offset, r.size, r.descriptor.offset if r.descriptor else None) for r in read_records(path)[0]}
    assert found == {r.name: (r.offset, r.size, r.descriptor) for r in index.records}
    for record in index.records:
        body = data[record.offset : record.offset + record.size]
        assert zlib.crc32(body) == record.crc == infos[record.name].CRC, record
        following = headers[headers.index(infos[record.name].header_offset) + 1]
        if record.size:
            assert record.descriptor == record.offset + record.size, record
            fields = DESCRIPTOR.unpack_from(data, record.descriptor)
            assert fields == (DESCRIPTOR_SIGNATURE, record.crc, record.size, record.size), record
            assert record.descriptor + DESCRIPTOR.size == following
        else:
            assert record.descriptor is None and record.offset == following, record
        assert data[following : following + 4] in (LOCAL_SIGNATURE, CENTRAL_SIGNATURE)
        assert data[record.central : record.central + 4] == CENTRAL_SIGNATURE
        assert struct.unpack_from("<I", data, record.central + CENTRAL_CRC_AT)[0] == record.crc
    assert not index.unset_tensor_crcs() and not index.unset_crcs()


def _zeroed_tensor_crcs(data: bytes, index: _ZipIndex) -> bytes:
    """``data`` with the CRC-32 fields of every tensor record set to 0, as a streamed save leaves them."""
    zeroed = bytearray(data)
    for record in index.records:
        if record.is_tensor:
            struct.pack_into("<I", zeroed, record.central + CENTRAL_CRC_AT, 0)
            if record.descriptor is not None:
                struct.pack_into("<I", zeroed, record.descriptor + DESCRIPTOR_CRC_AT, 0)
    return bytes(zeroed)


def _pieces_of(data: bytes, index: _ZipIndex, rng: random.Random) -> _CrcLedger:
    """Every non-empty tensor record's bytes noted in random pieces, in random order: what the ranks of a parallel
    save note as they write."""
    ledger, pieces = _CrcLedger(), []
    for record in index.records:
        if record.is_tensor:
            for start, end in _split(rng, record.size, rng.randint(1, 6)):
                pieces.append((record.offset + start, data[record.offset + start : record.offset + end]))
    rng.shuffle(pieces)
    for offset, piece in pieces:
        ledger.note(offset, piece)
    return ledger


def test_write_record_crcs_restores_the_saved_file(tmp_path):
    """A copy of a ``torch.save`` file whose tensor records' CRC-32 fields are zeroed (descriptors and central
    directory), as a streamed save leaves them: the CRC-32s combined from random pieces of the records, written
    with ``_write_record_crcs``, give back the original file byte for byte."""
    original = tmp_path / "original.ckpt"
    _save(original)
    data = original.read_bytes()
    streamed = tmp_path / "streamed.ckpt"
    streamed.write_bytes(_zeroed_tensor_crcs(data, _ZipIndex.read(str(original))))
    index = _ZipIndex.read(str(streamed))
    assert index.unset_tensor_crcs() and not index.unset_crcs()
    with zipfile.ZipFile(streamed) as archive:
        assert archive.testzip() is not None  # the zeroed fields are seen
    crcs = _record_crcs(index, _pieces_of(data, index, random.Random(0)).pieces)
    assert sorted(crcs) == sorted(r.name for r in index.records if r.is_tensor and r.size > 0)
    _write_record_crcs(str(streamed), index, crcs)
    assert streamed.read_bytes() == data


def test_record_crcs_refuses_pieces_that_do_not_tile_the_records(tmp_path):
    """A record with a byte not written (a gap, or its last bytes missing), with bytes written twice (an overlap),
    or a piece outside the tensor records (in ``data.pkl``, across two records, past the last one): ``RuntimeError``,
    never a CRC-32 of bytes that were not (or not only once) written."""
    path = tmp_path / "checkpoint.ckpt"
    _save(path)
    data = path.read_bytes()
    index = _ZipIndex.read(str(path))
    tensors = sorted((r for r in index.records if r.is_tensor and r.size > 0), key=lambda r: r.offset)
    whole = [(r.offset, r.size, zlib.crc32(data[r.offset : r.offset + r.size])) for r in tensors]
    assert _record_crcs(index, whole) == {r.name: r.crc for r in tensors}
    big = max(tensors, key=lambda r: r.size)
    others = [piece for piece in whole if piece[0] != big.offset]

    def piece(start: int, end: int) -> Tuple[int, int, int]:
        return big.offset + start, end - start, zlib.crc32(data[big.offset + start : big.offset + end])

    half = big.size // 2
    not_written_once = {
        "gap": [piece(0, half), piece(half + 4, big.size)],
        "short": [piece(0, big.size - 1)],
        "missing": [],
        "overlap": [piece(0, half + 4), piece(half, big.size)],
        "twice": [piece(0, big.size), piece(0, half)],
    }
    for case, pieces in not_written_once.items():
        with pytest.raises(RuntimeError, match=f"the record '{big.name}' of the checkpoint was not written exactly"):
            _record_crcs(index, others + pieces)
    pickle = next(r for r in index.records if r.name.endswith("/data.pkl"))
    last = tensors[-1]
    outside = {
        "data.pkl": (pickle.offset, 8, zlib.crc32(data[pickle.offset : pickle.offset + 8])),
        "across two records": (tensors[0].offset, tensors[1].offset + 1 - tensors[0].offset, 0),
        "past the last record": (last.offset + last.size, 4, 0),
        "before the first record": (0, 4, 0),
    }
    for case, bad in outside.items():
        with pytest.raises(RuntimeError, match="outside the tensor records of the file"):
            _record_crcs(index, whole + [bad])
