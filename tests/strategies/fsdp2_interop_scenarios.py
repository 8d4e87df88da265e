"""A checkpoint of the fork's FSDP loaded by torch FSDP2 (``fully_shard``) on CPU processes over gloo:
``python -m tests.strategies.fsdp2_interop_scenarios fsdp2 --out DIR --optimizers adam,sgd``.

For each optimizer, in the same 2 ranks: the fork's ``DDPFullyShardedStrategy`` (the CPU harness's stand-in) fits
the model and saves a checkpoint. Then the same model, as a plain torch job defines it, is sharded with
``fully_shard`` (each block, then the root, which holds a parameter outside the blocks) and loaded two ways:

- ``full``: ``set_model_state_dict`` / ``set_optimizer_state_dict(StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))`` with the file's ``state_dict`` and ``named_optimizer_state`` of its optimizer state,
  read on global rank 0 only;
- ``dcp``: global rank 0 converts the file with ``convert_checkpoint --to dcp``; every rank ``dcp.load``\\s its shards
  into ``get_state_dict``'s sharded templates and sets them with ``set_state_dict``, as torchtitan does.

Global rank 0 compares each model's full state (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``full_state_dict=True``) with the file's, then takes one step (the same batch on both ranks) and compares again with
the plain model and the plain optimizer, loaded from the file, after the same step on one process.

Every rank writes ``<out>/rank<N>.json``; driven by ``test_fsdp2_interop.py``.
"""
import argparse
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
    StateDictOptions,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from fsdp_harness.tensor_compare import compare_tensors
from pytorch_lightning import seed_everything, Trainer
from pytorch_lightning.utilities import named_optimizer_state
from pytorch_lightning.utilities.apply_func import apply_to_collection
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint, import_dcp

WIDTH, UNITS = 8, 2
FULL_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
FULL_READ = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _model(optimizer: str) -> FSDPModel:
    seed_everything(3)
    return FSDPModel(width=WIDTH, units=UNITS, batches=2, extra_before=True, optimizer=optimizer)


def _fork_checkpoint(args: argparse.Namespace, optimizer: str) -> Path:
    """The checkpoint of a 2-rank fit with the fork's FSDP strategy."""
    trainer = Trainer(**quiet_trainer_kwargs(args.out, args.devices, strategy=CPUFullyShardedStrategy(), max_epochs=1))
    trainer.fit(_model(optimizer))
    path = args.out / f"{optimizer}.ckpt"
    trainer.save_checkpoint(path)
    return path


def _plain(optimizer: str) -> Tuple[FSDPModel, torch.optim.Optimizer]:
    """The model as a plain torch job builds it (FairScale's ``wrap`` does nothing outside FSDP), and its optimizer."""
    model = _model(optimizer)
    model.configure_sharded_model()
    return model, model.configure_optimizers()


def _sharded(optimizer: str) -> Tuple[FSDPModel, torch.optim.Optimizer]:
    """The plain model sharded with FSDP2 over every rank: each block, then the root (with ``before``)."""
    model = _model(optimizer)
    model.configure_sharded_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layer:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model.configure_optimizers()


def _load_full(checkpoint: Dict[str, Any], optimizer: str) -> Tuple[FSDPModel, torch.optim.Optimizer]:
    model, optim = _sharded(optimizer)
    zero = global_rank() == 0
    # a copy of the dict: torch replaces its values with the sharded parameters
    set_model_state_dict(model, dict(checkpoint["state_dict"]) if zero else {}, options=FULL_LOAD)
    named = named_optimizer_state(checkpoint["optimizer_states"][0]) if zero else {}
    set_optimizer_state_dict(model, optim, named, options=FULL_LOAD)
    return model, optim


def _load_dcp(directory: Path, optimizer: str) -> Tuple[FSDPModel, torch.optim.Optimizer]:
    model, optim = _sharded(optimizer)
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(11))
    prediction = model(batch)
    nn.functional.mse_loss(prediction, torch.ones_like(prediction)).backward()
    optim.step()
    optim.zero_grad()


def _compare(expected: Dict[str, Any], actual: Dict[str, Any]) -> Dict[str, Any]:
    """Every tensor bit for bit, and the groups' hyperparameters and parameter names (``groups``: the keys that
    differ, per group)."""
    compared = compare_tensors(expected, actual)
    groups = [
        sorted(f"{k}: {e.get(k)!r} != {a.get(k)!r}" for k in set(e) | set(a) if _listed(e.get(k)) != _listed(a.get(k)))
        for e, a in zip(expected["optim"]["param_groups"], actual["optim"]["param_groups"])
    ]
    groups = groups if len(expected["optim"]["param_groups"]) == len(actual["optim"]["param_groups"]) else ["count"]
    max_diff = max(
        [float((a - b).abs().max()) for a, b in _pairs(expected, actual) if a.shape == b.shape and a.numel()] or [0.0]
    )
    return {**compared, "groups": groups, "max_diff": max_diff, "ok": compared["ok"] and not any(groups)}


def _listed(value: Any) -> Any:
    # torch's ``broadcast_from_rank0`` hands the groups' tuples (Adam's ``betas``) over as lists
    return list(value) if isinstance(value, tuple) else value


def _pairs(expected: Dict[str, Any], actual: Dict[str, Any]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    from fsdp_harness.tensor_compare import iter_tensors

    right = dict(iter_tensors(actual))
    return [(t.double(), right[path].double()) for path, t in iter_tensors(expected) if path in right]


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """The model's and optimizer's full state on global rank 0 (collective), cloned: torch hands out the
    optimizer's own ``step`` tensors, which the next step increments in place."""
    state = {
        "model": get_model_state_dict(model, options=FULL_READ),
        "optim": get_optimizer_state_dict(model, optim, options=FULL_READ),
    }
    return apply_to_collection(state, torch.Tensor, torch.clone)


def _read(path: Path) -> Dict[str, Any]:
    """The checkpoint, read anew for each use: optimizers keep loaded tensors as their state and update them in
    place (memory-mapped privately, the file itself never changes)."""
    return pl_load(str(path), map_location="cpu", mmap=True)


def _portable(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    return {"model": checkpoint["state_dict"], "optim": named_optimizer_state(checkpoint["optimizer_states"][0])}


def _plain_after_step(path: Path, optimizer: str) -> Dict[str, Any]:
    """The plain model and optimizer, loaded from the file, after one step on this process alone."""
    checkpoint = _read(path)
    model, optim = _plain(optimizer)
    model.load_state_dict(checkpoint["state_dict"])
    state = checkpoint["optimizer_states"][0]
    optim.load_state_dict({key: value for key, value in state.items() if key != "param_names"})
    _step(model, optim)
    return {"model": model.state_dict(), "optim": named_optimizer_state(optim.state_dict(), state["param_names"])}


def fsdp2(args: argparse.Namespace) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for optimizer in args.optimizers.split(","):
        path = _fork_checkpoint(args, optimizer)
        directory = args.out / f"{optimizer}.dcp"
        if global_rank() == 0:
            convert_checkpoint(path, directory, to="dcp", progress=False)
        dist.barrier()
        stepped = _plain_after_step(path, optimizer)
        cases = {}
        for how in ("full", "dcp"):
            model, optim = _load_full(_read(path), optimizer) if how == "full" else _load_dcp(directory, optimizer)
            loaded = _full_state(model, optim)
            _step(model, optim)
            after_step = _full_state(model, optim)
            if global_rank() == 0:
                cases[how] = {"loaded": _compare(_portable(_read(path)), loaded), "step": _compare(stepped, after_step)}
            if how == "dcp":
                cases["back"] = _back_from_fsdp2(args, optimizer, model, optim, after_step)
        result[optimizer] = {"cases": cases, "param_names": "param_names" in _read(path)["optimizer_states"][0]}
    return result


def _back_from_fsdp2(
    args: argparse.Namespace, optimizer: str, model: nn.Module, optim: torch.optim.Optimizer, state: Dict[str, Any]
) -> Dict[str, Any]:
    """FSDP2 saves its sharded state with DCP in the converter's layout; global rank 0 converts it back with
    ``--from dcp``; the file equals FSDP2's full ``state``, and the fork's FSDP resumes from it on the same ranks
    (one more epoch)."""
    model_state, optim_state = get_state_dict(model, optim)
    directory, path = args.out / f"{optimizer}.back.dcp", args.out / f"{optimizer}.back.ckpt"
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))
    if global_rank() == 0:
        import_dcp(directory, path)
    dist.barrier()
    compared = _compare(state, _portable(_read(path))) if global_rank() == 0 else {}
    trainer = Trainer(**quiet_trainer_kwargs(args.out, args.devices, strategy=CPUFullyShardedStrategy(), max_epochs=2))
    trainer.fit(_model(optimizer), ckpt_path=str(path))
    return {"file": compared, "resumed_step": trainer.global_step}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizers", default="adam,sgd")


if __name__ == "__main__":
    main({"fsdp2": fsdp2}, add_arguments)
