"""A checkpoint moves between the fork's FSDP, DDP and a single device with its optimizer state (issue 28), on CPU:
``python -m tests.strategies.fsdp_portable_scenarios fit --strategy fsdp|ddp|single --out DIR ...``; driven by
``test_ddp_fully_sharded_portable.py``.

``fit`` trains ``--epochs`` epochs of one model of the matrix (``--model``, ``--optimizer``, ``--groups``, ...) under
``--strategy``, from ``--ckpt`` if given; ``ModelCheckpoint`` saves after every epoch. Every strategy and world size
sees the same global batches (a single device gets both ranks' halves in one batch), so that runs under different
strategies are comparable. Each rank writes ``rank<N>.pt``: the full parameters at the end, and its optimizer state
by original parameter name (see :func:`optimizer_entries`) right after the restore (at ``on_train_start``) and at
the end. A run that raises records the error in ``rank<N>.json`` instead of stopping the batch, so that every rank's
error can be checked and the cases after it still run.
"""
import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import _clean_key, full_parameters, optimizer_parameter_names
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint
from tests.strategies.fsdp_collective_fault_scenarios import _outcome
from tests.strategies.fsdp_resume_scenarios import ResumeModel
from tests.strategies.fsdp_transformers_scenarios import TransformersModule

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# samples per optimizer step over all ranks
GLOBAL_BATCH = 4


def _loader(module: LightningModule, data: Dataset) -> DataLoader:
    """The global batches of ``data`` in order, each rank its share: rank r of 2 gets the samples r, r + 2, ... (a
    ``DistributedSampler`` without shuffling, which Lightning keeps; its own shuffles), one device all of them."""
    world_size = module.trainer.world_size
    if world_size == 1:
        return DataLoader(data, batch_size=GLOBAL_BATCH)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=module.trainer.global_rank, shuffle=False)
    return DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


class PortableModel(ResumeModel):
    """``ResumeModel`` (blocks of linear layers, one FSDP unit each, inside an outer unit) with what the matrix needs.

    Args:
        groups: ``"one"`` param group; ``"units"``: one group per block (FSDP unit), with the learning rate
            ``lr * (1 + block index)``, and one more for the parameters outside the blocks; ``"no_decay_bias"``: no
            weight decay on the biases, which FSDP cannot express (a bias shares its unit's flat parameter with a
            weight).
        hidden: the width between the blocks (default ``width``): another shape of the same parameters.
        outside: a parameter (``before``) and a linear layer (``head``) that are not wrapped, outside FSDP.
        bias: whether the blocks' linear layers have a bias; without, each FSDP unit holds one parameter, so a flat
            parameter's shard stands where the plain model's parameter would.
    """

    def __init__(self, *args: Any, groups: str = "one", hidden: Optional[int] = None, outside: bool = False,
                 bias: bool = True, **kwargs: Any) -> None:
        # read by ``_blocks``, which ``ResumeModel.__init__`` calls
        self.hidden, self.bias = hidden, bias
        super().__init__(*args, extra_before=outside, **kwargs)
        self.groups = groups
        self.head = nn.Linear(self.width, self.width) if outside else None

    def _blocks(self) -> nn.Sequential:
        widths = [self.width] + [self.hidden or self.width] * (self.units - 1) + [self.width]
        blocks = nn.Sequential(*[nn.Sequential(nn.Linear(widths[i], widths[i + 1], bias=self.bias), nn.Tanh())
                                 for i in range(self.units)])
        for index in self.frozen_blocks:
            blocks[index].requires_grad_(False)
        return blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x if self.head is None else self.head(x)

    def _loader(self) -> DataLoader:
        data = torch.randn(self.batches * GLOBAL_BATCH, self.width, generator=torch.Generator().manual_seed(1234))
        return _loader(self, data)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.groups == "one":
            return super().configure_optimizers()
        # by name, which names a unit's flat parameter under FSDP (``layer.0.flat_param_0``) as it names the unit's
        # own parameters elsewhere (``layer.0.0.weight``)
        named = [(_clean_key(name), p) for name, p in self.named_parameters() if p.requires_grad]
        if self.groups == "units":
            groups = [{"params": [p for n, p in named if n.startswith(f"layer.{i}.")], "lr": self.lr * (1 + i)}
                      for i in range(self.units)]
            groups.append({"params": [p for n, p in named if not n.startswith("layer.")]})
            groups = [group for group in groups if group["params"]]
        else:
            groups = [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
                      {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(groups, lr=self.lr)
        return torch.optim.SGD(groups, lr=self.lr, momentum=0.9)


class PortableGPT2(TransformersModule):
    """The tiny random GPT-2 (``lm_head.weight`` tied to ``transformer.wte.weight``), each block its own FSDP unit in
    an outer one that holds the tied weight, with the global batches of the matrix."""

    def __init__(self) -> None:
        super().__init__("gpt2", "block")

    def train_dataloader(self) -> DataLoader:
        return _loader(self, super().train_dataloader().dataset)


def make_model(args: argparse.Namespace) -> LightningModule:
    if args.model == "gpt2":
        return PortableGPT2()
    return PortableModel(
        width=args.width, units=args.units, optimizer=args.optimizer, batches=4, build=args.build,
        frozen_blocks=tuple(args.frozen), groups=args.groups, hidden=args.hidden, outside=args.outside,
        bias=not args.no_bias,
    )


def optimizer_entries(module: nn.Module, optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """This rank's optimizer state, one entry per parameter the optimizer holds, in its order: the names and shapes
    of the original parameters (several for a flat parameter), whether the state is this rank's shard of their
    concatenation (``sharded``, padded like FSDP's shards) or the parameter's whole state, and the state."""
    params = [(p, group["lr"]) for group in optimizer.param_groups for p in group["params"]]
    entries = []
    for (param, lr), names in zip(params, optimizer_parameter_names(module, optimizer)):
        state = {key: value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
                 for key, value in optimizer.state.get(param, {}).items()}
        sharded = hasattr(param, "_param_shapes")  # a FairScale flat parameter
        shapes = [list(shape) for shape in param._param_shapes] if sharded else [list(param.shape)]
        entries.append({"names": names, "shapes": shapes, "sharded": sharded, "state": state, "lr": lr})
    return entries


def plain_parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> List[str]:
    """The names of the optimizer's parameters in the order of its ``state_dict()`` (a plain model's)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


class RecordRestored(Callback):
    """The optimizer state when training starts, i.e. right after the restore."""

    entries: Optional[List[Dict[str, Any]]] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.entries = optimizer_entries(pl_module, trainer.optimizers[0])


def _strategy(name: str) -> Any:
    return {"fsdp": CPUFullyShardedStrategy(), "ddp": "ddp", "single": None}[name]


def _ckpt(args: argparse.Namespace) -> Optional[str]:
    """``--ckpt``, or with ``--optimizer-from`` a file with ``--ckpt``'s weights and loops and the optimizer state of
    ``--optimizer-from``: an optimizer state that cannot be mapped to a model whose weights load."""
    if not args.optimizer_from:
        return args.ckpt
    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    other = torch.load(args.optimizer_from, map_location="cpu", weights_only=True)
    checkpoint["optimizer_states"] = other["optimizer_states"]
    path = args.out / f"spliced-rank{global_rank()}.ckpt"  # a file per rank: no rank reads another's half-written
    torch.save(checkpoint, path)
    return str(path)


def fit(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit ``--epochs`` epochs (see the module's docstring); ``--fresh-optimizer`` resumes the weights and loops but
    starts the optimizer state fresh, the control that the comparisons can fail."""
    seed_everything(7)
    model = make_model(args)
    record = RecordRestored()
    trainer = Trainer(**quiet_trainer_kwargs(
        args.out, args.devices, accelerator=args.accelerator, strategy=_strategy(args.strategy),
        max_epochs=args.epochs, limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(args.out / "ckpts"), save_top_k=-1, filename="{epoch}"), record],
    ))
    if args.fresh_optimizer:
        trainer.strategy.load_optimizer_state_dict = lambda checkpoint: None
    result: Dict[str, Any] = {"rank": global_rank(), "error": None}
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=_ckpt(args))
        except Exception as error:
            result["error"] = _outcome(start, error)
    result["optimizer_warnings"] = [str(w.message) for w in caught if "optimizer state" in str(w.message)]
    if torch.distributed.is_initialized():
        # the next case of the batch may read this run's last file before it loads anything through Lightning
        torch.distributed.barrier()
    if result["error"] is not None:
        return result
    optimizer = trainer.optimizers[0]
    if args.legacy:
        write_legacy(trainer, args.out / "ckpts" / f"epoch={args.epochs - 1}.ckpt", args.out / "legacy.ckpt")
    torch.save(
        {"params": full_parameters(model), "restored": record.entries, "final": optimizer_entries(model, optimizer)},
        args.out / f"rank{trainer.global_rank}.pt",
    )
    result.update(
        world_size=trainer.world_size,
        global_step=trainer.global_step,
        # for a plain run, the names of its checkpoint's optimizer state, which holds none
        param_names=None if args.strategy == "fsdp" else plain_parameter_names(model, optimizer),
    )
    return result


def write_legacy(trainer: Trainer, path: Path, legacy: Path) -> None:
    """``legacy``: ``path`` (the last save of the run) with the optimizer state that Lightning 1.6.5 saved under
    FSDP, global rank 0's own ``optimizer.state_dict()`` (over its shards of the flat parameters). Collective."""
    if trainer.global_rank == 0:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        checkpoint["optimizer_states"] = [optimizer.state_dict() for optimizer in trainer.optimizers]
        torch.save(checkpoint, legacy)
    trainer.strategy.barrier()  # no rank resumes from it before it is written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", choices=["fsdp", "ddp", "single"], required=True)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--optimizer-from", default=None, help="a checkpoint whose optimizer state replaces --ckpt's")
    parser.add_argument("--fresh-optimizer", action="store_true")
    parser.add_argument("--model", default="blocks", choices=["blocks", "gpt2"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--groups", default="one", choices=["one", "units", "no_decay_bias"])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--frozen", type=int, nargs="*", default=[])
    parser.add_argument("--outside", action="store_true")
    parser.add_argument("--build", default="init", choices=["init", "sharded"])
    parser.add_argument("--no-bias", action="store_true")
    parser.add_argument("--legacy", action="store_true", help="also write the last file as Lightning 1.6.5 did")


if __name__ == "__main__":
    main({"fit": fit}, add_arguments)
