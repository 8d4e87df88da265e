"""Multi-process FSDP scenarios on CPU (2 ranks over gloo), run as ``python -m tests.strategies.fsdp_cpu_scenarios``.

Each scenario runs on every rank and returns a JSON-able dict; tests in ``test_ddp_fully_sharded_cpu.py`` drive
them with a timeout and compare what the ranks report.
"""
import argparse
from typing import Any, Dict

import torch

from pytorch_lightning import Trainer, seed_everything
from tests.helpers.cpu_fsdp import CPUFullyShardedStrategy
from tests.helpers.fsdp_models import FSDPModel, full_parameters
from tests.helpers.scenario import main


def trainer_kwargs(args: argparse.Namespace, **overrides: Any) -> Dict[str, Any]:
    kwargs = dict(
        accelerator="cpu",
        devices=args.devices,
        strategy=CPUFullyShardedStrategy(),
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(args.out),
    )
    kwargs.update(overrides)
    return kwargs


def tensor_summary(state: Dict[str, Any]) -> Dict[str, Any]:
    return {k: [list(v.shape), float(v.double().sum())] for k, v in state.items() if isinstance(v, torch.Tensor)}


def fit_and_save(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit with nested ``wrap`` in ``configure_sharded_model``, save, and compare the file with the parameters."""
    seed_everything(1)
    model = FSDPModel(width=16, units=3, wrapping="wrap")
    trainer = Trainer(**trainer_kwargs(args))
    trainer.fit(model)
    path = args.out / "model.ckpt"
    trainer.save_checkpoint(path)
    full = full_parameters(model)
    result: Dict[str, Any] = {"rank": trainer.global_rank, "full_param_keys": sorted(full)}
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        result["file_keys"] = sorted(state)
        result["mismatched"] = sorted(k for k in full if k not in state or not torch.equal(state[k], full[k]))
        # The sharded flat parameters are not what was saved: each rank holds only a slice.
        result["local_numel"] = sum(p.numel() for p in model.parameters())
        result["full_numel"] = sum(v.numel() for v in full.values())
    return result


if __name__ == "__main__":
    main({"fit_and_save": fit_and_save})
