"""Multi-process FSDP scenarios on CPU (2 ranks over gloo), run as ``python -m tests.strategies.fsdp_cpu_scenarios``.

Each scenario runs on every rank and returns a JSON-able dict; tests in ``test_ddp_fully_sharded_cpu.py`` drive
them with a timeout and compare what the ranks report.
"""
import argparse
from pathlib import Path
from typing import Any, Dict, List

import torch

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from fsdp_harness.tensor_compare import iter_tensors
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint


def trainer_kwargs(args: argparse.Namespace, **overrides: Any) -> Dict[str, Any]:
    strategy = CPUFullyShardedStrategy(
        state_dict_on_rank_0_only=getattr(args, "rank0_only", "on") == "on", min_num_params=100
    )
    return quiet_trainer_kwargs(args.out, args.devices, **{"strategy": strategy, "max_epochs": 1, **overrides})


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


def compare_file(path: Path, full: Dict[str, torch.Tensor], model_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Load ``path`` into a plain (unsharded) copy of the model, strictly, and compare it with ``full``."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    plain = FSDPModel(**model_kwargs)
    plain.configure_sharded_model()  # outside enable_wrap, ``wrap`` returns the plain module
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    reloaded = plain.state_dict()
    return {
        "keys": sorted(checkpoint["state_dict"]),
        "has_optimizer_states": "optimizer_states" in checkpoint,
        "mismatched": sorted(k for k in full if not torch.equal(reloaded[k], full[k])),
    }


def checkpoint_contents(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit with ModelCheckpoint(save_last, top-2), then save full and weights-only checkpoints; report what each
    rank held and, on rank 0, how every written file compares with the gathered parameters."""
    seed_everything(2)
    model_kwargs = dict(width=16, units=3, wrapping=args.wrapping, extra_before=True, extra_after=True)
    model = FSDPModel(**model_kwargs)
    checkpoint_callback = ModelCheckpoint(dirpath=args.out / "ckpts", monitor="val_loss", save_last=True, save_top_k=2)
    trainer = Trainer(
        **trainer_kwargs(args, max_epochs=3, enable_checkpointing=True, callbacks=[checkpoint_callback])
    )
    trainer.fit(model)
    trainer.save_checkpoint(args.out / "full.ckpt")
    trainer.save_checkpoint(args.out / "weights.ckpt", weights_only=True)
    # Collective calls, on every rank: what would each rank put into a checkpoint?
    module_state = trainer.strategy.lightning_module_state_dict()
    dumped = trainer._checkpoint_connector.dump_checkpoint()
    full = full_parameters(model)
    result: Dict[str, Any] = {
        "rank": trainer.global_rank,
        "module_state_keys": sorted(module_state),
        "module_state_tensors": len(list(iter_tensors(module_state))),
        "dumped_state_dict_tensors": len(list(iter_tensors(dumped["state_dict"]))),
        "dumped_optimizer_state_keys": sorted(dumped["optimizer_states"][0]),
        "full_keys": sorted(full),
        "fsdp_instances": sum(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()),
    }
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        last = Path(checkpoint_callback.last_model_path)
        files: List[Path] = [args.out / "full.ckpt", args.out / "weights.ckpt", last]
        result["files"] = {p.name: compare_file(p, full, model_kwargs) for p in files}
        top_k = sorted(Path(p).name for p in checkpoint_callback.best_k_models)
        result["top_k"] = top_k
        result["top_k_loadable"] = all(
            not compare_file(args.out / "ckpts" / name, {}, model_kwargs)["mismatched"] for name in top_k
        )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank0-only", choices=["on", "off"], default="on", help="state_dict_on_rank_0_only")
    parser.add_argument("--wrapping", choices=["wrap", "auto_wrap"], default="wrap")


if __name__ == "__main__":
    main({"fit_and_save": fit_and_save, "checkpoint_contents": checkpoint_contents}, add_arguments)
