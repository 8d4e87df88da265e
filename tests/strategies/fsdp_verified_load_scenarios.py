"""Multi-process scenarios of the check of a checkpoint's CRC-32s on an FSDP resume (``DDPFullyShardedStrategy`` with
its default ``checkpoint_writers``) on 2 CPU ranks, run as ``python -m tests.strategies.fsdp_verified_load_scenarios``;
driven by ``test_ddp_fully_sharded_verified_load.py``.

``save`` fits :class:`VerifiedLoadModel` and saves ``good.ckpt``; every rank works out, from the FSDP flat
parameters' pieces and each rank's shard range, which ranks read which state-dict key on a load; then global rank 0
makes the damaged copies of the file before the ranks meet again: one bit flipped (:data:`FLIPS`) in a record read by
rank 0 only, one read by rank 1 only, one read by both, an optimizer flat state's, a tied name's own, one outside
FSDP, or a float of the pickle; the file truncated; the file with no tensor CRC-32s, as earlier fork revisions wrote
it; a file whose weight is a view of a larger storage, with a bit flipped in the weight (:data:`VIEW`). ``resume``
resumes from one of them and records what it raised, how many training and validation batches started, the info
lines, and (``--record-reads``) which records each rank read parts of through ``fsdp_introspection._note_read``.
"""
import argparse
import logging
import os
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple
from unittest import mock

import torch
from torch import nn

from fsdp_harness.corrupt_checkpoint import (
    flip_bit,
    make_bad_checkpoint,
    pickle_record,
    pickled_float_byte,
    record_byte,
    record_of_keys,
    zero_tensor_crcs,
    zip_records,
)
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.strategies import fsdp_introspection, fsdp_restore
from pytorch_lightning.strategies.fsdp_introspection import _flat_parameter_keys, _named_fsdp_instances, _shard_range
from pytorch_lightning.utilities.checkpoint_verification import VERIFY_ENV
from pytorch_lightning.utilities.exceptions import CheckpointError
from tests.strategies.fsdp_stream_scenarios import TiedFSDPModel, default_strategy
from tests.strategies.fsdp_writer_decision_scenarios import LogLines

WIDTH = 32
#: the steps of the fit that saves; a resume asks for more, so that it would train if nothing stopped it
SAVED_STEPS, RESUMED_STEPS = 2, 4
#: the damaged copies of ``good.ckpt`` with one bit flipped: the state-dict key whose record holds the flipped bit
#: (``None``: a float of the pickle), where in the record (a fraction of it), and which ranks read the record on a
#: 2-rank load. The flat parameter of ``normed`` is the LayerNorm's weight and bias (32 + 32 elements), then the
#: Linear's weight (1024) and bias (32): rank 0's shard is elements [0, 560), rank 1's [560, 1120).
FLIPS: Dict[str, Tuple[Any, float, List[int]]] = {
    "rank0_only": ("state_dict.normed.0.weight", 0.5, [0]),
    "rank1_only": ("state_dict.normed.1.bias", 0.5, [1]),
    # the weight's elements [0, 496) are rank 0's, [496, 1024) rank 1's: the bit is in rank 0's part
    "both_ranks": ("state_dict.normed.1.weight", 0.25, [0, 1]),
    # Adam's exp_avg of ``normed``'s flat parameter, one record of its 4 pieces' views: each rank reads its shard's
    # range of it (the bit is in rank 1's)
    "optimizer_flat": ("optimizer_states.0.state.12.exp_avg", 0.9, [0, 1]),
    # the tied name's own record, which the load marks loaded without reading: each rank checks its half (the bit is
    # in rank 1's)
    "tied_share": ("state_dict.tied.2.weight", 0.75, []),
    # a parameter outside FSDP: every rank reads and checks it whole
    "outside_fsdp": ("state_dict.before", 0.5, []),
    "pickle": (None, 0.0, []),
}
#: a copy of ``good.ckpt`` whose ``VIEW_KEY`` is a view of a larger storage, with a bit flipped in the view's bytes
VIEW, VIEW_KEY = "view_of_a_larger_storage", "state_dict.normed.1.weight"
#: the info line of a file loaded unchecked
UNCHECKED = "is loaded without checking its CRC-32s"


class VerifiedLoadModel(TiedFSDPModel):
    """``TiedFSDPModel`` (tied weights inside an FSDP unit, parameters and a metric outside FSDP) and an FSDP unit whose
    flat parameter begins with a LayerNorm's small pieces and ends with a Linear's bias: on 2 ranks the LayerNorm's
    records are read by rank 0 only, the bias's by rank 1 only, and the Linear's weight's by both."""

    def configure_sharded_model(self) -> None:
        from fairscale.nn import wrap

        if self.layer is not None:
            return
        super().configure_sharded_model()
        self.normed = wrap(nn.Sequential(nn.LayerNorm(self.width), nn.Linear(self.width, self.width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normed(super().forward(x))


def make_model(edited: Optional[str] = None) -> VerifiedLoadModel:
    """The model; with ``edited`` (comma-separated state-dict keys) an :class:`EditingModel`."""
    kwargs: Dict[str, Any] = dict(
        width=WIDTH, units=2, extra_before=True, extra_after=True, optimizer="adam", scheduler=True
    )
    return VerifiedLoadModel(**kwargs) if edited is None else EditingModel(edited.split(","), **kwargs)


class EditingModel(VerifiedLoadModel):
    """Adds 1 in place to the checkpoint's tensors ``edited`` (state-dict keys) in ``on_load_checkpoint``, as user
    code may: the memory-mapped tensors' pages become this process's own, and the load reads the edited bytes."""

    def __init__(self, edited: List[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.edited = edited

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        for key in self.edited:
            checkpoint["state_dict"][key].add_(1.0)


def _trainer(args: argparse.Namespace, max_steps: int, **kwargs: Any) -> Trainer:
    return Trainer(
        **quiet_trainer_kwargs(
            args.out, args.devices, strategy=default_strategy(), max_steps=max_steps, limit_val_batches=1,
            num_sanity_val_steps=1, **kwargs,
        )
    )


def shard_readers(module: nn.Module, world_size: int) -> Dict[str, List[int]]:
    """For every state-dict key of an FSDP flat parameter's piece (``state_dict.<key>``), the ranks whose shard range
    of the flat parameter (``_shard_range``, FairScale's ``chunk``) overlaps the piece, i.e. that read a part of its
    record on a load at ``world_size`` ranks. A tied name (no piece of its own) is left out."""
    readers: Dict[str, List[int]] = {}
    for prefix, instance in _named_fsdp_instances(module):
        for flat in instance.params:
            pieces, _ = _flat_parameter_keys(prefix, instance, flat)
            total = sum(shape.numel() for _, shape in pieces)
            ranges = [_shard_range(total, rank, world_size)[1:] for rank in range(world_size)]
            offset = 0
            for key, shape in pieces:
                end = offset + shape.numel()
                readers[f"state_dict.{key}"] = [r for r, (lo, hi) in enumerate(ranges) if lo < end and offset < hi]
                offset = end
    return readers


def save(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit and save ``good.ckpt``; global rank 0 makes the damaged copies of it (see the module's docstring)."""
    seed_everything(7)
    trainer = _trainer(args, SAVED_STEPS)
    trainer.fit(make_model())
    good = args.out / "good.ckpt"
    trainer.save_checkpoint(good)
    result: Dict[str, Any] = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "checkpoint_writers": trainer.strategy.checkpoint_writers,
        "readers": shard_readers(trainer.lightning_module, trainer.world_size),
    }
    if trainer.global_rank == 0:
        records = record_of_keys(good)
        flipped = {}
        for name, (key, fraction, _) in FLIPS.items():
            record = pickle_record(good).name if key is None else records[key]
            byte = pickled_float_byte(good) if key is None else record_byte(good, record, fraction)
            flip_bit(good, args.out / f"{name}.ckpt", byte)
            flipped[name] = {"record": record, "byte": byte}
        make_bad_checkpoint("truncated", good, args.out / "truncated.ckpt")
        result["view"] = _flipped_view_of_a_larger_storage(good, args.out / f"{VIEW}.ckpt")
        result.update(
            flipped=flipped,
            record_keys=records,
            zeroed=zero_tensor_crcs(good, args.out / "previous_revision.ckpt"),
        )
    trainer.strategy.barrier()
    return result


def _flipped_view_of_a_larger_storage(good: Path, path: Path) -> Dict[str, Any]:
    """Write at ``path`` the checkpoint of ``good`` whose :data:`VIEW_KEY` is a view of the first elements of a
    larger tensor (as a weight trimmed by user code, ``w[:n]``, is: ``torch.save`` writes its whole storage, so its
    record holds more bytes than the tensor), with one bit flipped in the tensor's bytes (a quarter into the record:
    in rank 0's shard). Returns the record, the flipped byte and the record ``zipfile`` finds damaged."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=False)
    key = VIEW_KEY.split(".", 1)[1]
    weight = checkpoint["state_dict"][key]
    larger = torch.cat([weight.flatten(), torch.zeros(16, dtype=weight.dtype)])
    checkpoint["state_dict"][key] = larger[: weight.numel()].view_as(weight)
    unflipped = path.with_name(f"unflipped-{path.name}")
    torch.save(checkpoint, unflipped)
    record = record_of_keys(unflipped)[VIEW_KEY]
    byte = record_byte(unflipped, record, 0.25)
    flip_bit(unflipped, path, byte)
    with zipfile.ZipFile(path) as archive:
        damaged = archive.testzip()
    return {"record": record, "byte": byte, "damaged": damaged, "size": zip_records(path)[record].size}


class CountBatches(Callback):
    """Counts the training and validation (sanity check included) batches that start."""

    def __init__(self) -> None:
        self.train = self.validation = 0

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self.train += 1

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self.validation += 1


@contextmanager
def recording_reads(trainer: Trainer, path: Path, reads: Set[str]) -> Iterator[None]:
    """Add to ``reads`` the record of every part of a tensor of the checkpoint at ``path`` that the load reports read
    (``fsdp_introspection._note_read`` with ``start < end``), and of every tied name's share (``_note_share``, as
    ``share:<record>``). The record is found without the check's own mapping: by the storage of the tensor among those
    of the loaded checkpoint, whose key path :func:`~fsdp_harness.corrupt_checkpoint.record_of_keys` maps to it."""
    records = record_of_keys(path)
    by_storage: Dict[int, str] = {}

    def record_of(tensor: torch.Tensor) -> str:
        if not by_storage:
            loaded = trainer._checkpoint_connector._loaded_checkpoint
            for key, value in _tensors(loaded, ""):
                by_storage[value.untyped_storage().data_ptr()] = records[key]
        return by_storage.get(tensor.untyped_storage().data_ptr(), "<not of the checkpoint>")

    note_read, note_share = fsdp_introspection._note_read, fsdp_restore._note_share

    def read(tensor: torch.Tensor, start: int, end: int, copied: Optional[torch.Tensor] = None) -> None:
        if start < end:
            reads.add(record_of(tensor))
        note_read(tensor, start, end, copied)

    def share(tensor: torch.Tensor, rank: int, world_size: int) -> None:
        reads.add(f"share:{record_of(tensor)}")
        note_share(tensor, rank, world_size)

    with mock.patch.object(fsdp_introspection, "_note_read", read), mock.patch.object(
        fsdp_restore, "_note_share", share
    ):
        yield


def _tensors(obj: Any, key: str) -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for name, value in obj.items():
            yield from _tensors(value, f"{key}.{name}" if key else str(name))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{key}.{i}" if key else str(i))


@contextmanager
def environment(name: str, value: Any) -> Iterator[None]:
    """``os.environ[name]`` is ``value`` (unchanged where ``None``) inside, and as it was after."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def resume(args: argparse.Namespace) -> Dict[str, Any]:
    """``fit(ckpt_path=--ckpt)`` for :data:`RESUMED_STEPS` steps (``--verify``: ``PL_CHECKPOINT_VERIFY`` meanwhile),
    catching a ``CheckpointError``; the record: its message and types, the global step, the training and validation
    batches that started, the info lines saying that the file is loaded unchecked, and with ``--record-reads`` the
    records this rank read parts of."""
    seed_everything(7)
    count = CountBatches()
    trainer = _trainer(args, RESUMED_STEPS, callbacks=[count])
    lines = LogLines()
    logger = logging.getLogger("pytorch_lightning")
    reads: Set[str] = set()
    recording = recording_reads(trainer, Path(args.ckpt), reads) if args.record_reads else mock.patch.dict({})
    result: Dict[str, Any] = {"rank": trainer.global_rank, "error": None, "error_types": []}
    logger.addHandler(lines)
    try:
        # ``--unchecked-rank``: that rank loads without a check of its own (as where it cannot check the file)
        verify = "0" if args.unchecked_rank == trainer.global_rank else args.verify
        with environment(VERIFY_ENV, verify), recording:
            trainer.fit(make_model(args.edit_in_place), ckpt_path=args.ckpt)
    except CheckpointError as ex:
        result.update(error=str(ex), error_types=[t.__name__ for t in type(ex).__mro__])
    finally:
        logger.removeHandler(lines)
    result.update(
        global_step=trainer.global_step,
        train_batches=count.train,
        validation_batches=count.validation,
        unchecked=[line for line in lines.lines if UNCHECKED in line],
        reads=sorted(reads),
    )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", default=None, help="resume: the file to resume from")
    parser.add_argument("--verify", default=None, help=f"resume: {VERIFY_ENV} while it resumes")
    parser.add_argument("--record-reads", action="store_true", help="resume: record the records read in parts")
    parser.add_argument("--unchecked-rank", type=int, default=None, help=f"resume: the rank with {VERIFY_ENV}=0")
    parser.add_argument(
        "--edit-in-place",
        default=None,
        help="resume: the state-dict keys (comma-separated) that on_load_checkpoint edits in place",
    )


if __name__ == "__main__":
    main({"save": save, "resume": resume}, add_arguments)
