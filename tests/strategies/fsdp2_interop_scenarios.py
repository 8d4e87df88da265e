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
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
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
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities import named_optimizer_state
from pytorch_lightning.utilities.apply_func import apply_to_collection
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint, import_dcp

WIDTH, UNITS = 8, 2
FULL_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
FULL_READ = StateDictOptions(full_state_dict=True, cpu_offload=True)


MODEL_KWARGS = dict(width=WIDTH, units=UNITS, batches=2, extra_before=True)


def _model(optimizer: str) -> FSDPModel:
    seed_everything(3)
    return FSDPModel(**MODEL_KWARGS, optimizer=optimizer)


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


def _portable(checkpoint: Dict[str, Any], names: Optional[List[List[str]]] = None) -> Dict[str, Any]:
    """The model's and the optimizers' state by name; several optimizers' states merged into one (their groups'
    hyperparameters are the same here). ``names``: each optimizer's parameter names, for a state without them."""
    states = checkpoint["optimizer_states"]
    named = [named_optimizer_state(s, names[i] if names else None) for i, s in enumerate(states)]
    if len(named) == 1:
        return {"model": checkpoint["state_dict"], "optim": named[0]}
    group = dict(named[0]["param_groups"][0], params=[n for s in named for g in s["param_groups"] for n in g["params"]])
    merged = {"state": {k: v for s in named for k, v in s["state"].items()}, "param_groups": [group]}
    return {"model": checkpoint["state_dict"], "optim": merged}


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
            if how == "dcp" and optimizer in args.back.split(","):
                cases["back"] = _back_from_fsdp2(args, optimizer, model, optim, after_step)
        result[optimizer] = {"cases": cases, "param_names": "param_names" in _read(path)["optimizer_states"][0]}
    return result


#: the DCP layouts ``--from dcp`` reads, as FSDP2 writes them in ``_back_from_fsdp2``
LAYOUTS = ("converter", "lightning2", "torchtitan", "replicated")


def _dcp_layout(
    layout: str, model: nn.Module, optim: torch.optim.Optimizer
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The state a DCP writer saves in ``layout``, and what it puts in ``meta.pt`` (Lightning 2.x's): the
    converter's (``model``, ``optim``), Lightning 2.x's (``model``, ``optimizer_0`` and ``optimizer_1``: see
    :class:`_TwoOptimizers`), torchtitan's (the model's keys at
    the top level, ``optimizer`` flattened, ``train_state``, ``lr_scheduler``, each rank's ``dataloader``), and
    torchtitan's again from a replicated (unsharded) model, every rank saving the same tensors: DCP then writes each
    entry from one rank, chosen for balance, and ``.metadata`` lists them rank by rank, out of the model's order."""
    if layout == "converter":
        model_state, optim_state = get_state_dict(model, optim)
        return {"model": model_state, "optim": optim_state}, {}
    if layout == "lightning2":
        state = {"model": get_model_state_dict(model)}
        for i, split in enumerate(_split(model, optim)):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, split)
        return state, {"epoch": 1, "global_step": 3, "lr_schedulers": []}
    full = layout == "replicated"
    model_state, optim_state = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=True)
    )
    train_state = {"step": torch.tensor(5, dtype=torch.int32), "ntokens_seen": torch.tensor(640)}
    others = {"lr_scheduler": {"last_epoch": 5, "base_lrs": [0.01]}, "dataloader": {f"dp_rank_{global_rank()}": b"x"}}
    return {**model_state, "optimizer": optim_state, "train_state": train_state, **others}, {}


def _split(model: nn.Module, optim: torch.optim.Optimizer) -> List[torch.optim.Optimizer]:
    """``optim`` as Lightning 2.x's two optimizers of :class:`_TwoOptimizers`, with its state and hyperparameters."""
    hyperparameters = {k: v for k, v in optim.param_groups[0].items() if k != "params"}
    optimizers = []
    for params in _TwoOptimizers.split(model):
        split = type(optim)([dict(hyperparameters, params=params)])
        split.state.update({p: optim.state[p] for p in params if p in optim.state})
        optimizers.append(split)
    return optimizers


class _TwoOptimizers(FSDPModel):
    """The model with two optimizers, as a Lightning 2.x run might have it: the parameter outside the blocks, and the
    blocks'."""

    @staticmethod
    def split(model: nn.Module) -> List[List[nn.Parameter]]:
        return [[model.before], list(model.layer.parameters())]

    def training_step(self, batch: torch.Tensor, batch_idx: int, optimizer_idx: int = 0) -> torch.Tensor:
        return self._loss(batch)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        hyperparameters = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        return [type(optimizer)([dict(hyperparameters, params=params)]) for params in self.split(self)]


def _back_from_fsdp2(
    args: argparse.Namespace, optimizer: str, model: nn.Module, optim: torch.optim.Optimizer, state: Dict[str, Any]
) -> Dict[str, Any]:
    """FSDP2 saves its state with DCP in each of :data:`LAYOUTS`; global rank 0 converts each back with ``--from
    dcp``. Each file equals FSDP2's full ``state`` (tensors bit for bit, the groups); then each is resumed (see
    :func:`_resumes`) by the fork's FSDP and by DDP on these ranks."""
    cases: Dict[str, Any] = {}
    for layout in LAYOUTS:
        saved, meta = _dcp_layout(layout, model, optim)
        directory, path = args.out / f"{optimizer}.{layout}.dcp", args.out / f"{optimizer}.{layout}.back.ckpt"
        dcp.save(saved, checkpoint_id=str(directory))
        if global_rank() == 0:
            if meta:
                torch.save(meta, directory / "meta.pt")
            prefix = "model." if layout in ("converter", "lightning2") else ""
            order = [key[len(prefix) :] for key in FileSystemReader(str(directory)).read_metadata().state_dict_metadata]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*start(ing)? fresh|.*left out")
                import_dcp(directory, path, progress=False)
            cases[layout] = {
                "file": _compare(_sorted_groups(state), _sorted_groups(_portable(_read(path)))),
                "model_order": [key for key in order if key in state["model"]] == list(state["model"]),
            }
        dist.barrier()
    resumed = _resumes(args, optimizer, ("fsdp", "ddp"))
    for layout, case in cases.items():
        case["resumed"] = resumed[layout]
    return {**cases, "stepped": resumed["stepped"]}


def _sorted_groups(portable: Dict[str, Any]) -> Dict[str, Any]:
    """``portable`` with each group's parameter names sorted: a file converted from DCP names them in the order of
    its ``.metadata``, and only the names matter to a resume."""
    groups = [dict(group, params=sorted(group["params"])) for group in portable["optim"]["param_groups"]]
    return {"model": portable["model"], "optim": dict(portable["optim"], param_groups=groups)}


def _strategy(name: str) -> Any:
    return {"fsdp": CPUFullyShardedStrategy(), "ddp": DDPStrategy(), "single": None}[name]


def _resumes(args: argparse.Namespace, optimizer: str, strategies: Tuple[str, ...]) -> Dict[str, Any]:
    """Each converted file in ``args.out`` resumed by each strategy on these ranks, up to its own global step (no
    training step), and saved again: the saved parameters and optimizer state equal the file's (by name, bit for
    bit), so the resume restored them all. Then the ``replicated`` file resumed for one training step more by each
    strategy: the states after that step equal the first strategy's (``stepped``, within float rounding: the
    strategies reduce the gradients in their own ways). Collective; the result is global rank 0's."""
    result: Dict[str, Any] = {"stepped": {}}
    for layout in LAYOUTS:
        path = args.out / f"{optimizer}.{layout}.back.ckpt"
        result[layout] = {}
        for name in strategies:
            resumed = _resume(args, optimizer, path, name, more_steps=0)
            if global_rank() == 0:
                result[layout][name] = _compare(_sorted_groups(_portable(_read(path))), _sorted_groups(resumed))
    path = args.out / f"{optimizer}.replicated.back.ckpt"
    before = _portable(_read(path))
    first = _resume(args, optimizer, path, strategies[0], more_steps=1)
    for name in strategies[1:]:
        other = _resume(args, optimizer, path, name, more_steps=1)
        if global_rank() == 0:
            result["stepped"][name] = {
                "max_diff": max(float((a.double() - b.double()).abs().max()) for a, b in _pairs(first, other)),
                "compared": len(_pairs(first, other)),
                "moved": max(float((a.double() - b.double()).abs().max()) for a, b in _pairs(first, before)),
            }
    return result


def _resume(args: argparse.Namespace, optimizer: str, path: Path, strategy: str, more_steps: int) -> Dict[str, Any]:
    """The state that ``strategy`` saves after resuming ``path`` and training ``more_steps`` steps, named (global
    rank 0's; collective). Lightning 2.x's file is resumed by :class:`_TwoOptimizers`."""
    two = ".lightning2." in path.name
    seed_everything(3)
    model = _TwoOptimizers(**MODEL_KWARGS, optimizer=optimizer) if two else _model(optimizer)
    resaved = args.out / f"{path.name}.{strategy}.{args.devices}.{more_steps}.ckpt"
    step = _read(path)["global_step"] + more_steps
    # the model's own sequential loader under every strategy: the same batches on one device as on one FSDP rank
    kwargs = dict(strategy=_strategy(strategy), max_steps=step, replace_sampler_ddp=False)
    trainer = Trainer(**quiet_trainer_kwargs(args.out, args.devices, **kwargs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*max_steps|.*num_workers|.*does not have many workers")
        trainer.fit(model, ckpt_path=str(path))
    trainer.save_checkpoint(resaved)
    if global_rank() != 0:
        return {}
    # DDP and one device save each optimizer's own state, by index in its order of the model's parameters
    plain = _plain(optimizer)[0]
    name_of = {id(p): name for name, p in plain.named_parameters()}
    groups = _TwoOptimizers.split(plain) if two else [[p for p in plain.parameters() if p.requires_grad]]
    return _portable(_read(resaved), [[name_of[id(p)] for p in params] for params in groups])


def resume_back(args: argparse.Namespace) -> Dict[str, Any]:
    """The files ``fsdp2`` converted (in ``args.out``), resumed by the fork's FSDP and on one device on
    ``args.devices`` (1) rank."""
    return {optimizer: _resumes(args, optimizer, ("fsdp", "single")) for optimizer in args.back.split(",")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizers", default="adam,sgd")
    parser.add_argument("--back", default="adam", help="the optimizers whose FSDP2 state goes back with --from dcp")


if __name__ == "__main__":
    main({"fsdp2": fsdp2, "resume_back": resume_back}, add_arguments)
