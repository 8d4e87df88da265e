"""The check, on load, of the bytes each process read of a local checkpoint file against the CRC-32 of their records.

A loaded (memory-mapped) checkpoint is opened for the check (:func:`_open_read_check`): the records' offsets and
CRC-32s come from the file's central directory and local headers, and each tensor of the checkpoint is matched to its
record by where its storage lies in the file's mapping (``/proc/self/maps``). The CRC-32s are computed over that
mapping, where the load reads the bytes, without a copy. The mapping is private: a tensor the LightningModule's
``on_load_checkpoint`` changed in place changes only this process's copy of its pages. So a record whose bytes do not
match is read again from the file with ``pread`` (see below) before it is called corrupt: an edit in place is not
mistaken for a corrupt file, and a file put in the checkpoint's place later is not read. Then:

- the code that reads parts of records (the FSDP load, which copies each rank's shards out of the full tensors, see
  ``fsdp_introspection._copy_flat_slice``) reports each range it reads (:func:`_note_read`), and its CRC-32 is
  computed right there; the ranks combine the CRC-32s of a record's pieces without the data (``crc32_combine``) in
  one exchange of a few integers per piece, and a record whose pieces do not cover it exactly (views that leave
  gaps), or that does not match, is read again whole by one of the ranks that have a check;
- every other record the load reads is read whole by every process, which checks it alone: the records outside FSDP,
  ``data.pkl`` and the small records beside it; the optimizer state is not read (nor checked) where the optimizers are
  not restored (``validate``, ``test``, ``predict``).

:func:`_finish_read_check` raises ``CheckpointError`` on a mismatch, before training or evaluation runs a step.
``PL_CHECKPOINT_VERIFY=0`` turns the check off.

The hooks are ``CheckpointConnector._load_and_validate_checkpoint`` (which opens the check) and
``CheckpointConnector.resume_end`` (which finishes it), through its ``_failures`` part; the converter
(:mod:`~pytorch_lightning.utilities.convert_checkpoint`) checks each record of its source whole as it first reads
it.
"""
# fork-feature: fork/verified-checkpoints.patch
import bisect
import os
import zipfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pytorch_lightning.utilities.checkpoint_crc import _crc32, _tiled_crc, _ZipIndex, _ZipRecord
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from pytorch_lightning.utilities.local_file_storage import _memory_of

#: ``0`` turns the check off (see :func:`_verify_wanted`).
VERIFY_ENV = "PL_CHECKPOINT_VERIFY"
#: How many bytes of a record read from the file (not mapped) are checked at a time.
_READ_BYTES = 8 * 2**20

#: A piece a process read: its CRC-32 piece, and whether it is a primary read (``True``) or a share of a record the
#: load marks loaded without reading it (a tied name's own record), which only counts where no process read it.
_ReadPiece = Tuple[int, int, int, bool]


def _verify_wanted() -> bool:
    """Whether loads check the CRC-32s (``PL_CHECKPOINT_VERIFY``, ``1`` by default).

    Raises:
        MisconfigurationException: if it is set to anything but ``0`` or ``1``.
    """
    value = os.environ.get(VERIFY_ENV, "").strip() or "1"
    if value not in ("0", "1"):
        raise MisconfigurationException(f"`{VERIFY_ENV}` must be 0 or 1, got {value!r}.")
    return value == "1"


class _ReadCheck:
    """The check of one loaded checkpoint file: see the module's docstring.

    Args:
        path: the local file.
        stat: its ``os.stat`` right after the load: the check reads only that file (opened for each read, so that
            a check whose load failed holds no descriptor).
        index: its records.
        tensors: every tensor of the checkpoint (in dicts, lists and tuples) with its key path.
        base: the address of the file's first byte in the mapping of the whole file the load made.
        name: how messages name the file (by default ``path``): the URL of an object whose local copy ``path`` is.
        copy: the sparse local copy of an object in object storage that ``path`` opens (see
            :mod:`~pytorch_lightning.utilities.sparse_object_copy`): a range read again is fetched first.
    """

    def __init__(
        self,
        path: str,
        stat: os.stat_result,
        index: _ZipIndex,
        tensors: List[Tuple[str, torch.Tensor]],
        base: int,
        name: Optional[str] = None,
        copy: Optional[Any] = None,
    ) -> None:
        self.path = path
        self.name = _redacted(name or path)
        self.copy = copy
        self._stat = stat
        self.index = index
        self._base = base
        self._records = sorted((r for r in index.records if r.size > 0), key=lambda r: r.offset)
        self._starts = [r.offset for r in self._records]
        #: the key paths of the tensors in each record
        self.keys: Dict[str, List[str]] = {}
        #: the storage of one of the mapping's tensors, which keeps the whole mapping alive while the check reads it
        #: (the tensor itself would not: user code may give it other storage)
        self._mapped: Optional[torch.UntypedStorage] = None
        for key, tensor in tensors:
            record = self._record_of(tensor)
            if record is not None:
                self.keys.setdefault(record.name, []).append(key)
                self._mapped = tensor.untyped_storage()
        #: what this process read of the records read in parts, by record name
        self.pieces: Dict[str, List[_ReadPiece]] = {}

    def _record_of(self, tensor: torch.Tensor) -> Optional[_ZipRecord]:
        """The record the storage of ``tensor`` lies in (it may be a part of it), if it is one of this file's."""
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        at = storage.data_ptr() - self._base
        i = bisect.bisect_right(self._starts, at) - 1
        if i < 0 or at + storage.nbytes() > self._records[i].offset + self._records[i].size:
            return None
        return self._records[i]

    def note(
        self,
        tensor: torch.Tensor,
        start: int,
        end: int,
        primary: bool = True,
        copied: Optional[torch.Tensor] = None,
    ) -> bool:
        """Note that elements ``start`` to ``end`` of ``tensor`` (flattened) are read, if it is one of this file's:
        the CRC-32 of their bytes is computed now, over ``copied`` where the reader just copied them there unchanged
        (the copy's pages are in memory and in cache, the mapping's may have to be faulted in again), else over the
        mapping. ``start >= end`` notes only that the record is read in parts. A tensor that is not contiguous
        counts as its whole record. Returns whether it is this file's."""
        record = self._record_of(tensor)
        if record is None:
            return False
        pieces = self.pieces.setdefault(record.name, [])
        if not tensor.is_contiguous():
            at, nbytes = record.offset, record.size
        else:
            itemsize = tensor.element_size()
            at = tensor.untyped_storage().data_ptr() - self._base + (tensor.storage_offset() + start) * itemsize
            nbytes = max(end - start, 0) * itemsize
        if nbytes <= 0:
            return True
        self._check_fetched(record, at, nbytes)
        if (
            copied is not None
            and tensor.is_contiguous()
            and copied.is_contiguous()
            and copied.dtype == tensor.dtype
            and copied.device.type == "cpu"
            and copied.numel() * copied.element_size() == nbytes
        ):
            crc = _crc32(_memory_of(copied.data_ptr(), nbytes))
        else:
            crc = self.mapped_crc_of(at, nbytes)
        pieces.append((at, nbytes, crc, primary))
        return True

    def mapped_crc_of(self, offset: int, size: int) -> int:
        """The CRC-32 of ``size`` bytes at ``offset`` of the file as the load's mapping holds them (where this process
        changed none of them, the file's)."""
        return _crc32(_memory_of(self._base + offset, max(size, 0)))

    def matches(self, record: _ZipRecord) -> Tuple[bool, int]:
        """Whether ``record``'s bytes match its CRC-32, and the CRC-32 found: over the mapping, and, where that does
        not match, read from the file (:meth:`crc_of`). A file that no longer holds the record (truncated since the
        load) is read, not mapped: a mapped page past its end would kill the process (``SIGBUS``).

        Raises:
            CheckpointError: if the check reads a local copy of an object that lacks some of the record's bytes: the
                load read zeros in their place.
        """
        self._check_fetched(record, record.offset, record.size)
        crc = self.mapped_crc_of(record.offset, record.size) if self._holds(record) else None
        if crc != record.crc:
            crc = self.crc_of(record.offset, record.size)
        return crc == record.crc, crc

    def _check_fetched(self, record: _ZipRecord, offset: int, size: int) -> None:
        """Raise where ``size`` bytes at ``offset`` of ``record``, which the load read, are missing from the local
        copy of an object: they read as zeros, which no CRC-32 check of the bytes fetched later would show."""
        if self.copy is not None and self.copy.missing(offset, size):
            raise CheckpointError(
                f"Loading the checkpoint {self.name!r} read bytes {offset} to {offset + size} of its record"
                f" {record.name!r} (holding {', '.join(self.keys.get(record.name, [])[:4]) or 'no tensor'}), which this"
                " rank had not fetched from the object: it read zeros there. Something besides the strategy's restore"
                " read the checkpoint's tensors (a callback's `on_load_checkpoint`?); nothing is resumed from it."
            )

    def _holds(self, record: _ZipRecord) -> bool:
        """Whether the file at the check's path is still the one loaded, and long enough to hold ``record``."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return False
        return os.path.samestat(stat, self._stat) and stat.st_size >= record.offset + record.size

    def crc_of(self, offset: int, size: int) -> int:
        """The CRC-32 of ``size`` bytes at ``offset`` of the file, read in steps of :data:`_READ_BYTES`.

        Raises:
            RuntimeError: if another file was put at its path since the load.
        """
        if self.copy is not None:
            self.copy.ensure(offset, size)
        with open(self.path, "rb", buffering=0) as f:
            if not os.path.samestat(os.fstat(f.fileno()), self._stat):
                raise RuntimeError(f"{self.name!r} was replaced after it was loaded, before its CRC-32s were checked")
            return _read_crc(f.fileno(), offset, size, self.name)

    def check_record_of(self, tensor: torch.Tensor) -> None:
        """Check the whole record ``tensor`` lies in, the first time one of its tensors is read (the converter reads
        every tensor whole, some as views into one record).

        Raises:
            CheckpointError: if its bytes do not match its CRC-32.
        """
        record = self._record_of(tensor)
        if record is None or record.name in self.pieces:
            return
        ok, crc = self.matches(record)
        self.pieces[record.name] = [(record.offset, record.size, crc, True)]
        if not ok:
            raise _corrupt(self.name, [self.describe(record, crc)])

    def note_share(self, tensor: torch.Tensor, rank: int, world_size: int) -> None:
        """Note this rank's even share of the record of ``tensor``, which the load marks loaded without reading (a
        tied name's own record): the ranks read it once between them."""
        numel = tensor.numel()
        lo, hi = numel * rank // world_size, numel * (rank + 1) // world_size
        self.note(tensor, lo, hi, primary=False)

    def whole_mismatches(self, skipped: Set[str]) -> List[str]:
        """Check every record that is not read in parts nor in ``skipped`` whole: the mismatches found, described."""
        found = []
        for record in self.index.records:
            if record.name in self.pieces or record.name in skipped or record.size == 0:
                continue
            ok, crc = self.matches(record)
            if not ok:
                found.append(self.describe(record, crc))
        return found

    def describe(self, record: _ZipRecord, crc: int) -> str:
        keys = self.keys.get(record.name)
        holds = f"the checkpoint keys {', '.join(repr(k) for k in keys[:8])}" if keys else "no tensor of the checkpoint"
        if keys and len(keys) > 8:
            holds += f" and {len(keys) - 8} more"
        return (
            f"its record {record.name!r} (bytes {record.offset} to {record.offset + record.size} of the file, holding"
            f" {holds}) has CRC-32 {record.crc:#010x}, but the bytes read are {crc:#010x}"
        )

    def combined_mismatches(
        self, every_rank: List[Dict[str, List[_ReadPiece]]], checkers: List[int], rank: int
    ) -> List[str]:
        """The records read in parts whose pieces, from every rank, do not combine into their CRC-32. A record whose
        pieces do not cover it exactly once, or do not match (the bytes of a process's mapping may differ from the
        file's), is checked whole from the file by one of the ranks ``checkers`` (those with a check): ``rank``'s
        share of them."""
        by_name = {record.name: record for record in self.index.records}
        untiled = []
        names = sorted({name for pieces in every_rank for name in pieces})
        for name in names:
            record = by_name[name]
            pieces = [piece for rank_pieces in every_rank for piece in rank_pieces.get(name, [])]
            primary = [p for p in pieces if p[3]] or pieces
            crcs_at: Dict[Tuple[int, int], Set[int]] = {}
            for at, nbytes, crc, _ in primary:
                crcs_at.setdefault((at, nbytes), set()).add(crc)
            # two ranks that read the same bytes and got different ones leave it untiled too
            agreed = all(len(crcs) == 1 for crcs in crcs_at.values())
            tiles = [(at, n, next(iter(c))) for (at, n), c in crcs_at.items()]
            if not agreed or _tiled_crc(record.offset, record.size, tiles) != record.crc:
                untiled.append(record)
        found = []
        share = untiled[checkers.index(rank) :: len(checkers)] if rank in checkers else []
        for record in share:
            crc = self.crc_of(record.offset, record.size)
            if crc != record.crc:
                found.append(self.describe(record, crc))
        return found

    def unread(self, prefix: str) -> Set[str]:
        """The records all of whose tensors are under the key ``prefix`` (not read where that part is not restored)."""
        return {name for name, keys in self.keys.items() if all(k.split(".")[0] == prefix for k in keys)}


def _read_crc(fd: int, offset: int, size: int, path: str) -> int:
    """The CRC-32 of ``size`` bytes at ``offset`` of the file ``fd`` (at ``path``), read in steps of
    :data:`_READ_BYTES` into one buffer."""
    crc = 0
    view = memoryview(bytearray(min(size, _READ_BYTES)))
    while size > 0:
        n = os.preadv(fd, [view[: min(size, len(view))]], offset)
        if n == 0:
            raise EOFError(f"{path!r} ends before byte {offset + size}")
        crc, offset, size = _crc32(view[:n], crc), offset + n, size - n
    return crc


#: The checks open in this process: the load's (one at a time), whose tensors :func:`_note_read` looks for.
_OPEN: List[_ReadCheck] = []


def _note_read(tensor: torch.Tensor, start: int, end: int, copied: Optional[torch.Tensor] = None) -> None:
    """Note that elements ``start`` to ``end`` of ``tensor`` (flattened) are read (into ``copied``, if given), if it
    belongs to a checkpoint being checked (see :meth:`_ReadCheck.note`); nothing otherwise."""
    for check in _OPEN:
        if check.note(tensor, start, end, copied=copied):
            return


def _note_share(tensor: torch.Tensor, rank: int, world_size: int) -> None:
    """See :meth:`_ReadCheck.note_share`."""
    for check in _OPEN:
        if check._record_of(tensor) is not None:
            check.note_share(tensor, rank, world_size)
            return


def _check_record_of(tensor: torch.Tensor) -> None:
    """See :meth:`_ReadCheck.check_record_of`; nothing where ``tensor`` belongs to no checkpoint being checked."""
    for check in _OPEN:
        check.check_record_of(tensor)


def _open_read_check(path: Any, checkpoint: Any) -> Optional[_ReadCheck]:
    """Open the check of ``checkpoint``, just loaded from ``path``, and make :func:`_note_read` see its tensors;
    ``None`` (with an info line saying why) where it cannot be checked, or ``PL_CHECKPOINT_VERIFY=0``. A check left
    open by a load that failed before :func:`_finish_read_check` is dropped (it holds no descriptor)."""
    while _OPEN:
        _close_read_check(_OPEN[-1])
    if not _verify_wanted():
        _drop_local_copies()
        return None
    path = str(path)
    try:
        check, why = _new_read_check(path, checkpoint)
    except (OSError, zipfile.BadZipFile, RuntimeError) as ex:
        # what ``torch.load`` read but the check cannot (a file replaced meanwhile, a tensor without a storage): the
        # load goes on unchecked rather than failing on the check's account
        check, why = None, f"{type(ex).__name__}: {ex}"
    if check is None:
        rank_zero_info(f"The checkpoint {_redacted(path)!r} is loaded without checking its CRC-32s: {why}.")
        return None
    _OPEN.append(check)
    return check


def _new_read_check(path: str, checkpoint: Any) -> Tuple[Optional[_ReadCheck], str]:
    """The check of ``checkpoint`` loaded from ``path``, or ``None`` and why it cannot be checked."""
    copy = _LOCAL_COPIES.pop(path, None)
    _drop_local_copies()
    if copy is not None:
        try:
            check, why = _new_local_read_check(copy.path, checkpoint, path, copy)
        except BaseException:
            copy.close()
            raise
        if check is None:
            copy.close()
        return check, why
    try:
        fs, local_path = url_to_fs(path)
    except (ValueError, ImportError):
        # a protocol fsspec does not know (a custom ``CheckpointIO``'s), or whose client is not installed
        return None, "it is not a local file (only local files are checked)"
    if not isinstance(fs, LocalFileSystem):
        return None, "it is not a local file (only local files are checked)"
    if "://" in path:
        path = local_path  # ``file://...``: read through the plain path
    return _new_local_read_check(path, checkpoint)


def _new_local_read_check(
    path: str, checkpoint: Any, name: Optional[str] = None, copy: Optional[Any] = None
) -> Tuple[Optional[_ReadCheck], str]:
    with open(path, "rb", buffering=0) as file:
        stat = os.fstat(file.fileno())
        if not os.path.samestat(stat, os.stat(path)):
            return None, "it was replaced while it was loaded"
        if not zipfile.is_zipfile(file):
            return None, "it is not in torch's zip format (a legacy file)"
    index = _ZipIndex.read(path)
    if index.unset_crcs():
        return None, "it was written with CRC-32 turned off (`torch.serialization.set_crc32_options(False)`)"
    if index.unset_tensor_crcs():
        return None, "its tensor records carry no CRC-32 (a streamed or parallel save of fork revision 110 or older)"
    tensors = list(_tensors_of(checkpoint, ""))
    base = _mapping_base(stat, index, tensors)
    if base is None:
        return None, "its tensors are not memory-mapped"
    return _ReadCheck(path, stat, index, tensors, base, name, copy), ""


def _close_read_check(check: Optional[_ReadCheck]) -> None:
    """Drop ``check`` without finishing it (its load failed), and close the local copy it read."""
    if check is not None and check in _OPEN:
        _OPEN.remove(check)
    if check is not None and check.copy is not None:
        check.copy.close()


#: The local copy of an object in object storage that the load just read (see
#: :mod:`~pytorch_lightning.utilities.sparse_object_copy`), by the URL the load was given, until its check opens.
_LOCAL_COPIES: Dict[str, Any] = {}


def _hand_local_copy_to_check(url: str, copy: Any) -> None:
    """Have the next :func:`_open_read_check` of ``url`` check the load's local ``copy`` of it, which it then closes
    (or closes unchecked, where the check is off or the next load is of another file)."""
    _drop_local_copies()
    _LOCAL_COPIES[url] = copy


def _drop_local_copies() -> None:
    for copy in _LOCAL_COPIES.values():
        copy.close()
    _LOCAL_COPIES.clear()


def _mapping_base(stat: os.stat_result, index: _ZipIndex, tensors: List[Tuple[str, torch.Tensor]]) -> Optional[int]:
    """The address of the file's first byte in the mapping of the file (of ``stat``) that ``torch.load(mmap=True)``
    made: one of the file's mappings at offset 0 in ``/proc/self/maps`` at which every tensor's storage lies inside
    a record; ``None`` where there is none (the load did not map the file, or ``/proc`` cannot be read)."""
    storages = [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for _, t in tensors if t.device.type == "cpu"
    ]
    storages = [(ptr, nbytes) for ptr, nbytes in storages if nbytes > 0]
    records = sorted((r for r in index.records if r.size > 0), key=lambda r: r.offset)
    starts = [r.offset for r in records]
    if not storages:
        return None

    def fits(base: int) -> bool:
        for ptr, nbytes in storages:
            i = bisect.bisect_right(starts, ptr - base) - 1
            if i < 0 or ptr - base + nbytes > records[i].offset + records[i].size:
                return False
        return True

    return next((base for base in _mappings_of(stat) if fits(base)), None)


def _mappings_of(stat: os.stat_result) -> List[int]:
    """The start addresses of this process's mappings of the whole file of ``stat`` (from its offset 0)."""
    starts = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and int(fields[4]) == stat.st_ino and int(fields[2], 16) == 0:
                    major, minor = (int(part, 16) for part in fields[3].split(":"))
                    start, end = (int(address, 16) for address in fields[0].split("-"))
                    if os.makedev(major, minor) == stat.st_dev and end - start >= stat.st_size:
                        starts.append(start)
    except (OSError, ValueError):
        return []
    return starts


def _tensors_of(obj: Any, key: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """The dense tensors in the dicts, lists and tuples of ``obj``, with their key paths (``state_dict.layer.weight``).
    A sparse or otherwise unstrided tensor has no storage of its own to look up: its records are checked whole."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            yield key, obj
    elif isinstance(obj, dict):
        for name, value in obj.items():
            yield from _tensors_of(value, f"{key}.{name}" if key else str(name))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors_of(value, f"{key}.{i}" if key else str(i))


def _finish_read_check(
    check: Optional[_ReadCheck],
    optimizer_states_read: bool,
    exchange: Optional[Callable[[Any], List[Any]]] = None,
    rank: int = 0,
) -> None:
    """Check the records read whole, and combine the pieces of those read in parts with every rank's (``exchange``,
    an all-gather of a small object by rank, whose caller is global rank ``rank``; ``None`` where this process read
    them alone), then close the check. Collective where ``exchange`` is given: every rank calls it, with or without a
    check of its own, and it exchanges even where its own part failed.

    Raises:
        CheckpointError: if a record's bytes do not match its CRC-32: on every rank for a record read whole or in
            parts, on one rank for a record whose pieces did not cover it (the caller's exchange of failures tells
            the others).
    """
    if check is not None and check in _OPEN:
        _OPEN.remove(check)
    found: List[str] = []
    # (the pieces read in parts, the mismatches of the records read whole, whether this rank has a check)
    mine: Tuple[Dict[str, List[_ReadPiece]], List[str], bool] = ({}, [], False)
    error: Optional[BaseException] = None
    try:
        if check is not None:
            skipped = set() if optimizer_states_read else check.unread("optimizer_states")
            # the ranks' pieces, with the records this rank only noted as read in parts (no pieces): a record that
            # only a rank without a check read is then still read again, by one that has one
            mine = (dict(check.pieces), check.whole_mismatches(skipped), True)
    except Exception as ex:
        error = ex
    try:
        everyone = exchange(mine) if exchange is not None else [mine]
        if error is not None:
            raise error
        if check is None:
            return
        found = [m for _, mismatches, _ in everyone for m in mismatches]
        # the records to read again are shared among the ranks that have a check: one without (a file it could not
        # check) would leave its share unread
        checkers = [i for i, (_, _, checked) in enumerate(everyone) if checked]
        found += check.combined_mismatches([pieces for pieces, _, _ in everyone], checkers, rank)
    finally:
        _close_read_check(check)
    if found:
        raise _corrupt(check.name, found)


def _corrupt(path: str, found: List[str]) -> CheckpointError:
    """The error that says the file at ``path`` is corrupt, for the records described in ``found``."""
    found = sorted(set(found))  # a record read whole is checked by every rank
    more = f" ({len(found) - 1} more records do not match either)" if len(found) > 1 else ""
    return CheckpointError(
        f"The checkpoint {path!r} is corrupt: {found[0]}{more}. Nothing is resumed from it; load an earlier"
        f" checkpoint, or set `{VERIFY_ENV}=0` to load it unchecked."
    )


def _finish_restore_check(trainer: Any) -> None:
    """:func:`_finish_read_check` of the check :func:`_open_read_check` opened for a ``Trainer``'s restore (if any),
    once the model, the callbacks, the loops and (when fitting) the optimizers were restored: its ranks exchange their
    pieces over the strategy's checkpoint group. Collective where more than one process runs."""
    from pytorch_lightning.trainer.states import TrainerFn
    from pytorch_lightning.utilities.checkpoint_errors import _all_gather_objects, _distributed_run

    strategy = trainer.strategy
    exchange = None
    if _distributed_run(trainer.world_size):

        def exchange(obj: Any) -> List[Any]:
            return _all_gather_objects(strategy, obj)

    check = _OPEN[-1] if _OPEN else None
    _finish_read_check(check, trainer.state.fn == TrainerFn.FITTING, exchange, trainer.global_rank)
