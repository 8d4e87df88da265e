"""Damaged checkpoint files, made from a good one, for the tests of what resuming from them does.

:func:`make_bad_checkpoint` makes the files that cannot be loaded (:data:`KINDS`); :func:`flip_bit` makes a file
that loads but whose bytes changed, at a byte picked with :func:`record_byte` (inside a zip record) or
:func:`pickled_float_byte` (a float of the pickle, which still unpickles); :func:`record_of_keys` says which record
holds which tensor, and :func:`zero_tensor_crcs` makes the file an earlier fork revision wrote, whose tensor records
carry no CRC-32."""
import io
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

#: Every kind :func:`make_bad_checkpoint` makes. ``missing`` writes nothing.
KINDS = ("missing", "empty", "random", "truncated", "not_a_checkpoint", "wrong_keys")


def make_bad_checkpoint(kind: str, good: Path, path: Path) -> None:
    """Write a checkpoint of ``kind`` (one of :data:`KINDS`) at ``path``, made from the good checkpoint ``good``."""
    if kind == "missing":
        return
    data = good.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        # as long as the good file, and the same bytes in every run
        generator = torch.Generator().manual_seed(0)
        path.write_bytes(torch.randint(0, 256, (len(data),), dtype=torch.uint8, generator=generator).numpy().tobytes())
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "not_a_checkpoint":
        torch.save([1, 2, 3], path)
    elif kind == "wrong_keys":
        # a loadable checkpoint whose state dict does not fit the model
        checkpoint = torch.load(good, weights_only=False)
        checkpoint["state_dict"] = {"encoder." + k: v for k, v in checkpoint["state_dict"].items()}
        torch.save(checkpoint, path)
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")


# Bit flips: one bit of a good file changed, the file otherwise intact (it still opens, and still unpickles where the
# flipped byte is a float's), which only a check of the records' CRC-32s can see. Written apart from the fork's own
# zip reader (``pytorch_lightning.utilities.checkpoint_crc``), so that the tests of the check do not take the code
# they check for their reference.

#: the signatures of a zip file's headers (local, data descriptor, central directory)
_LOCAL, _DESCRIPTOR, _CENTRAL = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"


class ZipRecord(NamedTuple):
    """One record of a checkpoint's zip archive, as :func:`zip_records` reads it."""

    name: str
    #: where its data begins in the file, and its size
    offset: int
    size: int
    #: its CRC-32 as the central directory has it
    crc: int
    #: where its data descriptor's CRC-32 lies (``None``: it has none), and its central-directory entry's
    descriptor_crc_at: Optional[int]
    central_crc_at: int

    @property
    def is_tensor(self) -> bool:
        """Whether it holds a tensor's storage (``<archive>/data/<key>``)."""
        return self.name.split("/")[-2:-1] == ["data"]


def zip_records(path: Path) -> Dict[str, ZipRecord]:
    """The records of the (uncompressed) zip archive at ``path``, by name, in the order of its central directory."""
    data = Path(path).read_bytes()
    records: Dict[str, ZipRecord] = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        at = archive.start_dir
        for info in archive.infolist():
            assert data[at : at + 4] == _CENTRAL, f"no central-directory entry for {info.filename!r} at {at}"
            name_length, extra_length, comment_length = struct.unpack_from("<HHH", data, at + 28)
            local = info.header_offset
            assert data[local : local + 4] == _LOCAL, f"no local header for {info.filename!r} at {local}"
            offset = local + 30 + sum(struct.unpack_from("<HH", data, local + 26))
            descriptor = None
            if info.flag_bits & 0x08 and info.file_size > 0:
                end = offset + info.compress_size
                assert data[end : end + 4] == _DESCRIPTOR, f"no data descriptor after {info.filename!r}"
                descriptor = end + 4
            records[info.filename] = ZipRecord(info.filename, offset, info.file_size, info.CRC, descriptor, at + 16)
            at += 46 + name_length + extra_length + comment_length
    return records


def flip_bit(good: Path, path: Path, byte: int, bit: int = 0) -> None:
    """Copy the file ``good`` to ``path`` with bit ``bit`` (0: the least significant) of its byte ``byte`` flipped."""
    data = bytearray(Path(good).read_bytes())
    if not 0 <= byte < len(data) or not 0 <= bit < 8:
        raise ValueError(f"no bit {bit} of byte {byte} in the {len(data)} bytes of {good}")
    data[byte] ^= 1 << bit
    Path(path).write_bytes(bytes(data))


def record_byte(path: Path, record: str, fraction: float = 0.5) -> int:
    """The byte of the file at ``path`` that lies ``fraction`` of the way into its zip record ``record`` (e.g.
    ``"archive/data/4"``): 0 is its first byte, 1 its last."""
    found = zip_records(path)[record]
    if found.size == 0:
        raise ValueError(f"the record {record!r} of {path} is empty")
    return found.offset + min(int(found.size * fraction), found.size - 1)


def pickle_record(path: Path) -> ZipRecord:
    """The record of the checkpoint's pickle (``<archive>/data.pkl``)."""
    return next(r for name, r in zip_records(path).items() if name.endswith("/data.pkl"))


def pickled_float_byte(path: Path, value: Optional[float] = None) -> int:
    """The byte of the file at ``path`` holding the least significant bits of the mantissa of a float in the
    checkpoint's pickle (the first one, or the first equal to ``value``): the last of the 8 big-endian bytes after a
    ``BINFLOAT`` opcode. Flipping its bit 0 changes the float by one unit in the last place, and the pickle still
    loads."""
    record = pickle_record(path)
    with open(path, "rb") as f:
        f.seek(record.offset)
        pickled = f.read(record.size)
    for opcode, arg, at in pickletools.genops(pickled):
        if opcode.name == "BINFLOAT" and (value is None or arg == value):
            assert struct.unpack(">d", pickled[at + 1 : at + 9])[0] == arg
            return record.offset + at + 8
    raise ValueError(f"no float {'' if value is None else value} in the pickle of {path}")


class _Stored(NamedTuple):
    """A tensor of the pickle, in place of the tensor: the key of its storage's record."""

    key: str


class _StorageKeys(pickle.Unpickler):
    """Unpickles a checkpoint's ``data.pkl`` with every tensor replaced by :class:`_Stored` (no storage is read)."""

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, numel)
        return str(pid[2])

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name.startswith("_rebuild_tensor"):
            return lambda storage, *args, **kwargs: _Stored(storage)
        if module == "torch._utils" and name.startswith("_rebuild_parameter"):
            return lambda data, *args, **kwargs: data
        if module == "torch._tensor" and name.startswith("_rebuild_from_type"):
            # a tensor of a subclass (a ``Parameter`` saved as it is): the tensor its function rebuilds
            return lambda function, subclass, args, *state: function(*args)
        return super().find_class(module, name)


def _stored_tensors(obj: Any, key: str) -> Iterator[Tuple[str, _Stored]]:
    if isinstance(obj, _Stored):
        yield key, obj
    elif isinstance(obj, dict):
        for name, value in obj.items():
            yield from _stored_tensors(value, f"{key}.{name}" if key else str(name))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _stored_tensors(value, f"{key}.{i}" if key else str(i))


def record_of_keys(path: Path) -> Dict[str, str]:
    """The record each tensor of the checkpoint at ``path`` lies in, by its key path (``state_dict.layer.weight``,
    ``optimizer_states.0.state.2.exp_avg``), read from the pickle alone."""
    record = pickle_record(path)
    prefix = record.name[: -len("data.pkl")]
    with open(path, "rb") as f:
        f.seek(record.offset)
        unpickled = _StorageKeys(io.BytesIO(f.read(record.size)), encoding="utf-8").load()
    return {key: f"{prefix}data/{stored.key}" for key, stored in _stored_tensors(unpickled, "")}


def zero_tensor_crcs(good: Path, path: Path) -> List[str]:
    """Copy the file ``good`` to ``path`` with the CRC-32 of every tensor record 0 in its data descriptor and its
    central-directory entry, as the streamed and parallel saves of earlier fork revisions wrote it (the pickle's and
    the small records' are kept). Returns the names of the records changed."""
    data = bytearray(Path(good).read_bytes())
    changed = []
    for record in zip_records(good).values():
        if not record.is_tensor or record.size == 0:
            continue
        for at in (record.descriptor_crc_at, record.central_crc_at):
            if at is not None:
                struct.pack_into("<I", data, at, 0)
        changed.append(record.name)
    Path(path).write_bytes(bytes(data))
    return changed
