"""Multi-process scenarios of streamed FSDP saves (``DDPFullyShardedStrategy(stream_checkpoint=True)``) on CPU,
run as ``python -m tests.strategies.fsdp_stream_scenarios``; driven by ``test_ddp_fully_sharded_stream.py``.

Each one saves the same state twice, streamed and gathered (``stream_checkpoint=False``, the path taken before),
and global rank 0 compares the two files entry by entry, every tensor and every other value.
"""
import argparse
import errno
from typing import Any, Callable, Dict, List, Optional
from unittest import mock

import torch
from torch import nn
from torchmetrics import MeanMetric

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from fsdp_harness.tensor_compare import iter_tensors
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.strategies import fsdp_streaming_save
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile
from pytorch_lightning.utilities.exceptions import CheckpointError


class TiedFSDPModel(FSDPModel):
    """Adds a block whose two linear layers share their weight, and a buffer, inside an FSDP unit, and a metric with
    persistent state outside FSDP (``Metric`` overrides ``_save_to_state_dict``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loss_mean = MeanMetric()
        self.loss_mean.persistent(True)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.loss_mean.update(loss.detach())
        return loss

    def configure_sharded_model(self) -> None:
        from fairscale.nn import wrap

        if self.layer is not None:
            return
        super().configure_sharded_model()
        first, second = nn.Linear(self.width, self.width), nn.Linear(self.width, self.width)
        second.weight = first.weight
        block = nn.Sequential(first, nn.Tanh(), second)
        block.register_buffer("scale", torch.arange(float(self.width)))
        self.tied = wrap(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied(super().forward(x)) * self.tied.scale.mean()


class ReadsStateOnSave(FSDPModel):
    """``on_save_checkpoint`` reads a value and replaces an entry, which placeholders could not give it."""

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        state_dict = checkpoint["state_dict"]
        if state_dict:  # global rank 0
            key = sorted(state_dict)[0]
            checkpoint["first_value"] = float(state_dict[key].reshape(-1)[0])
            state_dict[key] = state_dict[key] * 2


def strategy(args: argparse.Namespace, **kwargs: Any) -> CPUFullyShardedStrategy:
    """The scenarios' strategy: they are about global rank 0 writing the streamed file alone, so it pins
    ``checkpoint_writers="rank0"`` unless ``kwargs`` says otherwise (the parallel save's scenarios do)."""
    return default_strategy(**{"checkpoint_writers": "rank0", **kwargs})


def default_strategy(**kwargs: Any) -> CPUFullyShardedStrategy:
    """The scenarios' strategy with the defaults of every argument but ``kwargs``."""
    return CPUFullyShardedStrategy(min_num_params=100, **kwargs)


def make_model(args: argparse.Namespace) -> FSDPModel:
    kwargs = dict(width=16, units=3, extra_before=True, extra_after=True, optimizer=args.optimizer, scheduler=True)
    model_class = {
        "plain": FSDPModel,
        "tied": TiedFSDPModel,
        "hook": ReadsStateOnSave,
    }[args.model]
    return model_class(wrapping=args.wrapping, **kwargs)


def differences(actual: Any, expected: Any, path: str = "") -> List[str]:
    """Where two loaded checkpoints differ: keys, types, tensor dtypes, shapes and values, other values."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return [f"{path}: keys {list(actual) if isinstance(actual, dict) else type(actual)} != {list(expected)}"]
        metadata_differs = getattr(actual, "_metadata", None) != getattr(expected, "_metadata", None)
        if type(actual) is not type(expected) or metadata_differs:
            return [f"{path}: {type(actual).__name__} or its module versions differ"]
        return [d for k in expected for d in differences(actual[k], expected[k], f"{path}/{k}")]
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return [f"{path}: {type(actual).__name__} of {len(actual)} != {len(expected)}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected)) for d in differences(a, e, f"{path}/{i}")]
    if isinstance(expected, torch.Tensor):
        same = (
            isinstance(actual, torch.Tensor)
            and actual.dtype == expected.dtype
            and actual.shape == expected.shape
            and torch.equal(actual, expected)
        )
        return [] if same else [f"{path}: tensor differs"]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def load(path: str) -> Dict[str, Any]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    checkpoint.pop("pytorch-lightning_version", None)
    return checkpoint


def streamed_equals_gathered(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit, then save streamed and gathered, full and weights-only; rank 0 compares the files."""
    seed_everything(3)
    model = make_model(args)
    trainer = Trainer(**quiet_trainer_kwargs(args.out, args.devices, strategy=strategy(args), max_epochs=2))
    trainer.fit(model)
    result: Dict[str, Any] = {"rank": trainer.global_rank}
    for weights_only in (False, True):
        suffix = "-weights" if weights_only else ""
        trainer.strategy.stream_checkpoint = True
        trainer.save_checkpoint(args.out / f"streamed{suffix}.ckpt", weights_only=weights_only)
        result[f"stream_reason{suffix}"] = trainer.strategy._checkpoint_state.last_stream_reason
        trainer.strategy.stream_checkpoint = False
        trainer.save_checkpoint(args.out / f"gathered{suffix}.ckpt", weights_only=weights_only)
        if trainer.global_rank == 0:
            streamed, gathered = load(args.out / f"streamed{suffix}.ckpt"), load(args.out / f"gathered{suffix}.ckpt")
            if "first_value" in gathered:
                # read from the state by the hook, which saw the values in both saves
                result[f"first_value{suffix}"] = [streamed["first_value"], gathered["first_value"]]
            result[f"differences{suffix}"] = differences(streamed, gathered)
            result[f"tensors{suffix}"] = len(list(iter_tensors(gathered)))
            safe = torch.load(args.out / f"streamed{suffix}.ckpt", weights_only=True)
            result[f"weights_only_loads{suffix}"] = len(safe["state_dict"])
    result["temporary_files"] = sorted(p.name for p in args.out.glob("*.tmp"))
    return result


FAULTS = {"skeleton": 0, "units": 0, "optimizer": 1}  # where the fault is injected: the global rank it fails on


def inject_fault(trainer: Trainer, fault: str) -> Any:
    """A context in which the next streamed save fails on ``FAULTS[fault]`` only: on global rank 0 the disk fills up
    while the file's structure is written (``skeleton``) or at the second unit's parameter (``units``); on rank 1,
    moving a unit's optimizer state to the gather device fails (``optimizer``), while its gathers still run."""
    if trainer.global_rank != FAULTS[fault]:
        return mock.patch.dict({})
    if fault == "optimizer":
        stream_optimizer_state = fsdp_streaming_save._stream_optimizer_state

        def failing_to(tensor: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            raise RuntimeError("injected failure moving optimizer state")

        def stream_with_failure(*a: Any, **k: Any) -> None:
            with mock.patch.object(torch.Tensor, "to", failing_to):
                stream_optimizer_state(*a, **k)

        return mock.patch.object(fsdp_streaming_save, "_stream_optimizer_state", stream_with_failure)
    method = "write_skeleton" if fault == "skeleton" else "write"
    original, calls = getattr(_StreamedCheckpointFile, method), []

    def full_disk(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == (1 if method == "write_skeleton" else 2):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*a, **k)

    return mock.patch.object(_StreamedCheckpointFile, method, full_disk)


def fails_while_streaming(args: argparse.Namespace) -> Dict[str, Any]:
    """Save a good checkpoint; then, for each fault of ``FAULTS``, change the weights and save over it with that
    fault injected, and report what every rank raised and whether rank 0's file is unchanged. Then save again."""
    seed_everything(4)
    model = make_model(args)
    trainer = Trainer(**quiet_trainer_kwargs(args.out, args.devices, strategy=strategy(args), max_epochs=1))
    trainer.fit(model)
    path = args.out / "last.ckpt"
    return saves_over_it_with_faults(trainer, model, path, args.out, FAULTS, inject_fault)


def saves_over_it_with_faults(
    trainer: Trainer,
    model: Any,
    path: Any,
    out: Any,
    faults: Any,
    inject: Callable[[Trainer, str], Any],
    save: Optional[Callable[[Any], None]] = None,
) -> Dict[str, Any]:
    """Save ``path``; then, for each of ``faults``, change the weights and save over it inside ``inject(trainer,
    fault)``, recording what every rank raised and, on rank 0, whether the file is unchanged and which temporary
    files are left. Then save again (``after.ckpt``), which must still work. ``save`` saves a path (default
    ``trainer.save_checkpoint``; a save in the background also waits for it)."""
    save = save or trainer.save_checkpoint
    save(path)
    before = path.read_bytes() if trainer.global_rank == 0 else b""
    result: Dict[str, Any] = {"rank": trainer.global_rank}
    for fault in faults:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        result[f"raised-{fault}"] = None
        try:
            with inject(trainer, fault):
                save(path)
        except CheckpointError as ex:
            result[f"raised-{fault}"] = str(ex)
        if trainer.global_rank == 0:
            result[f"unchanged-{fault}"] = path.read_bytes() == before
            result[f"temporary_files-{fault}"] = sorted(p.name for p in out.glob("*.tmp"))
    save(out / "after.ckpt")
    if trainer.global_rank == 0:
        result["after_loads"] = len(load(out / "after.ckpt")["state_dict"])
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["plain", "tied", "hook"], default="plain")
    parser.add_argument("--wrapping", choices=["wrap", "auto_wrap"], default="wrap")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")


if __name__ == "__main__":
    main({"streamed_equals_gathered": streamed_equals_gathered, "fails_while_streaming": fails_while_streaming},
         add_arguments)
