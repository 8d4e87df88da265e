"""One rank of one benchmark run: ``python -m fsdp_benchmarks.worker save_and_resume --config NAME --out DIR ...``.

Lightning's launcher starts ranks >= 1 by re-running this command line, so it must stay a ``python -m`` module run
from the repository root. Every rank:

1. fits the model for one short epoch (so the optimizer has state) with the configuration's strategy;
2. **save**: ``trainer.save_checkpoint(path)`` on all ranks (it is collective), measured by :class:`PeakMemory`
   from just before the call (baseline after ``malloc_trim``) until it returns (in GPU mode also the CUDA
   allocator's peak, reset just before);
3. checks the file: all ranks gather the full parameters (collective), rank 0 maps the file and compares every
   model tensor exactly, and counts the optimizer-state values in it against a full optimizer state (one value per
   parameter for SGD's momentum, two for Adam's moments). A configuration whose checkpoint is incomplete by design
   (1.6.5 saves rank 0's optimizer shard) reports the count but is not failed for it. Configurations that stream
   the save (``stream_checkpoint=True``) then save again, unmeasured, with ``strategy.stream_checkpoint = False``
   to a second file, and rank 0 compares every tensor of the model state dict and of ``optimizer_states`` between
   the two files (:mod:`fsdp_harness.tensor_compare`);
4. **resume**: a fresh model and a fresh Trainer run ``fit(ckpt_path=path)``. Measured from the moment the
   strategy starts reading the checkpoint (``strategy.load_checkpoint``; baseline taken right there) until
   ``on_train_start``, i.e. after every restore (model, loops, optimizer, schedulers) and ``resume_end``, which drops
   the loaded checkpoint. The baseline is taken where the checkpoint starts to matter, so the figure is the cost of
   the checkpoint on top of what the rank held just before, whether Lightning restores before sharding (upstream
   1.6.5) or after. The wall time covers the same window (with upstream's order it includes wrapping the model).
   Training stops at ``on_train_start``; the resumed parameters are gathered and compared with the file again;
5. writes ``<out>/rank<N>.json`` (with the ``pytorch_lightning`` it imported, so the runner can check the build) (or, when it raises, ``<out>/rank<N>.error``; see :mod:`fsdp_harness.scenario`).
"""
import argparse
import os
from pathlib import Path
from typing import Any, Dict

import torch

import pytorch_lightning
from fsdp_benchmarks.configs import by_name
from fsdp_benchmarks.model import CheckpointModel, state_dict_mb
from fsdp_harness.memory_sampler import MIB, PeakMemory, memory_source
from fsdp_harness.models import full_parameters
from fsdp_harness.scenario import main
from fsdp_harness.tensor_compare import compare_tensors, iter_tensors
from pytorch_lightning import Callback, Trainer, seed_everything

# Optimizer-state values per model parameter in a complete checkpoint.
STATE_SLOTS = {"sgd": 1, "sgd-plain": 0, "adam": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--optimizer", choices=["sgd", "sgd-plain", "adam"], default="sgd")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--ckpt-dir", type=Path, help="where the checkpoint is written (default: --out)")


def make_strategy(args: argparse.Namespace) -> Any:
    config = by_name(args.config)
    kwargs = dict(config.strategy_kwargs)
    checkpoint_io = config.build_checkpoint_io()
    if checkpoint_io is not None:
        kwargs["checkpoint_io"] = checkpoint_io
    if args.accelerator == "gpu":
        from pytorch_lightning.strategies import DDPFullyShardedStrategy as strategy_cls
    else:
        from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy as strategy_cls
    return strategy_cls(**kwargs)


def make_model(args: argparse.Namespace) -> CheckpointModel:
    seed_everything(1234, workers=True)
    return CheckpointModel(args.size_mb, args.units, args.devices, optimizer=args.optimizer)


def make_trainer(args: argparse.Namespace, **overrides: Any) -> Trainer:
    kwargs = dict(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=make_strategy(args),
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(args.out),
    )
    kwargs.update(overrides)
    return Trainer(**kwargs)


def compare_with_file(model: torch.nn.Module, path: Path, rank: int) -> Dict[str, Any]:
    """Collective: gather the full parameters on all ranks; rank 0 compares them with the file and counts the
    optimizer-state values in it (0-d tensors, Adam's ``step``, not counted)."""
    full = full_parameters(model)
    if rank != 0:
        del full
        return {}
    # Memory-mapped: the check runs outside the measured windows, but need not hold a second copy of the file.
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    state = checkpoint["state_dict"]
    mismatched = sorted(k for k in full if k not in state or not torch.equal(state[k], full[k]))
    extra = sorted(k for k in state if k not in full)
    return {
        "checked_tensors": len(full),
        "mismatched": mismatched,
        "unexpected": extra,
        "ok": not mismatched and not extra,
        "parameters": sum(t.numel() for t in full.values()),
        "optimizer_state_values": sum(t.numel() for _, t in iter_tensors(checkpoint["optimizer_states"]) if t.dim()),
    }


def check_saved_file(model: torch.nn.Module, path: Path, rank: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Collective: :func:`compare_with_file`, plus whether the optimizer state is whole. Only configurations whose
    checkpoint should be complete fail for a partial one; 1.6.5's rank-0 shard is reported, not failed."""
    check = compare_with_file(model, path, rank)
    if rank == 0:
        expected = check["parameters"] * STATE_SLOTS[args.optimizer]
        check["optimizer_state_expected"] = expected
        check["optimizer_state_complete"] = check["optimizer_state_values"] == expected
        if by_name(args.config).complete:
            check["ok"] = check["ok"] and check["optimizer_state_complete"]
    return check


def verify_streamed_file(trainer: Trainer, path: Path, rank: int) -> Dict[str, Any]:
    """Collective: save again with the gathered path (unmeasured) and compare every tensor with the streamed file."""
    gathered = path.with_suffix(".gathered.ckpt")
    strategy = trainer.strategy
    strategy.stream_checkpoint = False
    try:
        trainer.save_checkpoint(gathered)
    finally:
        strategy.stream_checkpoint = True
    strategy.barrier("after-gathered-save")
    check: Dict[str, Any] = {}
    if rank == 0:
        # Memory-mapped, so the comparison holds no extra copy of either file.
        files = [torch.load(p, map_location="cpu", mmap=True, weights_only=False) for p in (path, gathered)]
        check = compare_tensors(*({k: f[k] for k in ("state_dict", "optimizer_states")} for f in files))
        del files
        gathered.unlink()
    strategy.barrier("after-stream-check")
    return check


class ResumeProbe(Callback):
    """Starts the measurement when the strategy begins reading the checkpoint; stops it at ``on_train_start``."""

    def __init__(self, cuda: bool) -> None:
        self.meter = PeakMemory()
        self.cuda = cuda
        self.result: Dict[str, Any] = {}

    def setup(self, trainer: Trainer, pl_module: Any, stage: Any = None) -> None:
        # ``setup`` runs before any restore; wrap this strategy instance's ``load_checkpoint`` only.
        strategy = trainer.strategy
        if self.cuda:
            self.meter.cuda_device = strategy.root_device
        original = strategy.load_checkpoint
        meter = self.meter

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if not meter.running:
                meter.start()
            return original(*args, **kwargs)

        strategy.load_checkpoint = load_checkpoint

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.meter.running:
            self.result = self.meter.stop()
        trainer.should_stop = True


def save_and_resume(args: argparse.Namespace) -> Dict[str, Any]:
    ckpt_dir = args.ckpt_dir or args.out
    path = Path(ckpt_dir) / f"{args.config}-n{args.devices}.ckpt"
    model = make_model(args)
    trainer = make_trainer(args)
    trainer.fit(model)
    rank = trainer.global_rank
    width = model.width

    cuda = args.accelerator == "gpu"
    trainer.strategy.barrier("before-save")
    with PeakMemory(cuda_device=trainer.strategy.root_device if cuda else None) as save:
        trainer.save_checkpoint(path)
    trainer.strategy.barrier("after-save")
    save_check = check_saved_file(model, path, rank, args)
    checkpoint_mb = os.path.getsize(path) / MIB if rank == 0 else None
    stream_check = verify_streamed_file(trainer, path, rank) if by_name(args.config).streams else None
    trainer.strategy.barrier("after-check")
    del trainer, model

    # Resume in a fresh Trainer with a fresh model (same seeds), through the public API.
    model = make_model(args)
    probe = ResumeProbe(cuda)
    trainer = make_trainer(args, max_epochs=2, callbacks=[probe])
    trainer.fit(model, ckpt_path=str(path))
    if not probe.result:
        raise RuntimeError("the resume measurement never started or never stopped")
    load_check = compare_with_file(model, path, rank)
    trainer.strategy.barrier("after-resume-check")

    result: Dict[str, Any] = {
        "rank": rank,
        "config": args.config,
        "world_size": args.devices,
        "accelerator": args.accelerator,
        "width": width,
        "units": args.units,
        "unit_mb": state_dict_mb(width, 1),
        "state_dict_mb": state_dict_mb(width, args.units),
        "memory_source": memory_source(),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "lightning_version": pytorch_lightning.__version__,
        "lightning_file": pytorch_lightning.__file__,
        "save": save.result(),
        "load": probe.result,
    }
    if rank == 0:
        result.update(
            checkpoint_mb=checkpoint_mb,
            save_check=save_check,
            load_check=load_check,
            ok=bool(save_check["ok"] and load_check["ok"] and (stream_check is None or stream_check["ok"])),
        )
        if stream_check is not None:
            result["stream_check"] = stream_check
    return result


if __name__ == "__main__":
    main({"save_and_resume": save_and_resume}, add_arguments)
