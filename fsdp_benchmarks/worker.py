"""One rank of one benchmark run: ``python -m fsdp_benchmarks.worker save_and_resume --config NAME --out DIR ...``.

Lightning's launcher starts ranks >= 1 by re-running this command line, so it must stay a ``python -m`` module run
from the repository root. Every rank:

1. fits the model for one short epoch (so the optimizer has state) with the configuration's strategy;
2. **save**: ``trainer.save_checkpoint(path)`` on all ranks (it is collective), measured by :class:`PeakMemory`
   from just before the call (baseline after ``malloc_trim``) until it returns;
3. checks the file: all ranks gather the full parameters (collective), rank 0 loads the file and compares every
   model tensor exactly;
4. **resume**: a fresh model and a fresh Trainer run ``fit(ckpt_path=path)``. Measured from the moment the
   strategy starts reading the checkpoint (``strategy.load_checkpoint``; baseline taken right there) until
   ``on_train_start``, i.e. after every restore (model, loops, optimizer, schedulers) and ``resume_end``, which drops
   the loaded checkpoint. The baseline is taken where the checkpoint starts to matter, so the figure is the cost of
   the checkpoint on top of what the rank held just before, whether Lightning restores before sharding (upstream
   1.6.5) or after. The wall time covers the same window (with upstream's order it includes wrapping the model).
   Training stops at ``on_train_start``; the resumed parameters are gathered and compared with the file again;
5. writes ``<out>/rank<N>.json`` (or, when it raises, ``<out>/rank<N>.error``; see :mod:`fsdp_harness.scenario`).
"""
import argparse
import os
from pathlib import Path
from typing import Any, Dict

import torch

from fsdp_benchmarks.configs import by_name
from fsdp_benchmarks.model import CheckpointModel, state_dict_mb
from fsdp_harness.memory_sampler import MIB, PeakMemory, memory_source
from fsdp_harness.models import full_parameters
from fsdp_harness.scenario import main
from pytorch_lightning import Callback, Trainer, seed_everything


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
    """Collective: gather the full parameters on all ranks; rank 0 compares them with the file."""
    full = full_parameters(model)
    if rank != 0:
        del full
        return {}
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    mismatched = sorted(k for k in full if k not in state or not torch.equal(state[k], full[k]))
    extra = sorted(k for k in state if k not in full)
    return {"checked_tensors": len(full), "mismatched": mismatched, "unexpected": extra, "ok": not mismatched and not extra}


class ResumeProbe(Callback):
    """Starts the measurement when the strategy begins reading the checkpoint; stops it at ``on_train_start``."""

    def __init__(self) -> None:
        self.meter = PeakMemory()
        self.result: Dict[str, Any] = {}

    def setup(self, trainer: Trainer, pl_module: Any, stage: Any = None) -> None:
        # ``setup`` runs before any restore; wrap this strategy instance's ``load_checkpoint`` only.
        strategy = trainer.strategy
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

    trainer.strategy.barrier("before-save")
    with PeakMemory() as save:
        trainer.save_checkpoint(path)
    trainer.strategy.barrier("after-save")
    save_check = compare_with_file(model, path, rank)
    checkpoint_mb = os.path.getsize(path) / MIB if rank == 0 else None
    trainer.strategy.barrier("after-check")
    del trainer, model

    # Resume in a fresh Trainer with a fresh model (same seeds), through the public API.
    model = make_model(args)
    probe = ResumeProbe()
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
        "save": save.result(),
        "load": probe.result,
    }
    if rank == 0:
        result.update(
            checkpoint_mb=checkpoint_mb,
            save_check=save_check,
            load_check=load_check,
            ok=bool(save_check["ok"] and load_check["ok"]),
        )
    return result


if __name__ == "__main__":
    main({"save_and_resume": save_and_resume}, add_arguments)
