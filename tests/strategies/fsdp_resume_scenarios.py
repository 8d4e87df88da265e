"""Resume scenarios for ``DDPFullyShardedStrategy`` on CPU (gloo), run as
``python -m tests.strategies.fsdp_resume_scenarios``; driven by ``test_ddp_fully_sharded_resume.py``.

Every scenario writes, per rank, ``rank<N>.json`` (a summary) and ``rank<N>.pt`` with the full model parameters
(gathered on every rank) and the rank's *local* optimizer state (its shard), which the tests compare.
"""
import argparse
import warnings
from typing import Any, Dict, List

import torch
from torch.utils.data import DataLoader

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.memory_sampler import MIB, PeakMemory
from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.scenario import global_rank, main
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.exceptions import MisconfigurationException

WIDTH = 8


class ResumeModel(FSDPModel):
    """``FSDPModel`` (layers created in ``configure_sharded_model``) with data that does not depend on the global
    RNG, so a resumed run sees exactly the batches the uninterrupted run saw."""

    def __init__(self, *args: Any, param_groups: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.param_groups = param_groups

    def _loader(self) -> DataLoader:
        data = torch.randn(self.batches * 2 * 2, self.width, generator=torch.Generator().manual_seed(1234))
        return DataLoader(data, batch_size=2)

    def configure_optimizers(self):
        if self.param_groups == 1:
            return super().configure_optimizers()
        params = list(self.parameters())
        groups = [{"params": params[:1]}, {"params": params[1:], "lr": self.lr / 2}]
        return torch.optim.SGD(groups, lr=self.lr, momentum=0.9)


def make_model(args: argparse.Namespace, **overrides: Any) -> ResumeModel:
    kwargs = dict(
        width=WIDTH, units=2, optimizer=args.optimizer, scheduler=args.scheduler, batches=4, wrapping=args.wrapping
    )
    kwargs.update(overrides)
    return ResumeModel(**kwargs)


def make_trainer(args: argparse.Namespace, max_epochs: int, **strategy_kwargs: Any) -> Trainer:
    return Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=CPUFullyShardedStrategy(**{"min_num_params": args.min_num_params, **strategy_kwargs}),
        max_epochs=max_epochs,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        # saves at the end of every training epoch, on all ranks (the strategy writes on rank 0)
        callbacks=[ModelCheckpoint(dirpath=str(args.out / "ckpts"), save_top_k=-1, filename="{epoch}")],
        default_root_dir=str(args.out),
    )


def local_optimizer_states(trainer: Trainer) -> List[Dict[str, Any]]:
    return [optimizer.state_dict() for optimizer in trainer.optimizers]


def report(args: argparse.Namespace, trainer: Trainer, model: ResumeModel, **extra: Any) -> Dict[str, Any]:
    """Save this rank's full parameters and local optimizer state; return a JSON summary."""
    rank = trainer.global_rank
    params = full_parameters(model)
    optim = local_optimizer_states(trainer)
    torch.save({"params": params, "optim": optim}, args.out / f"rank{rank}.pt")
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "lrs": [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups],
    }
    result.update(extra)
    return result


def fit(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit ``--epochs`` epochs, optionally resuming from ``--ckpt``; ModelCheckpoint saves every epoch."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=args.epochs)
    trainer.fit(model, ckpt_path=args.ckpt)
    return report(args, trainer, model)


def consolidate(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit one epoch, then call ``optimizer_state`` directly: the full state on rank 0, nothing elsewhere."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    trainer.fit(model)
    before = [{k: dict(v) for k, v in s["state"].items()} for s in local_optimizer_states(trainer)]
    before = [{k: {n: t.clone() for n, t in v.items()} for k, v in s.items()} for s in before]
    full = trainer.strategy.optimizer_state(trainer.optimizers[0])
    after = local_optimizer_states(trainer)[0]["state"]
    unchanged = all(
        type(after[k][n]) is type(t) and torch.equal(torch.as_tensor(after[k][n]), torch.as_tensor(t))
        for k, v in before[0].items()
        for n, t in v.items()
    )
    if trainer.global_rank == 0:
        torch.save(full, args.out / "consolidated.pt")
    return {"rank": trainer.global_rank, "full_keys": sorted(full), "local_state_unchanged": unchanged}


def memory(args: argparse.Namespace) -> Dict[str, Any]:
    """Peak host-memory growth of each rank while the optimizer state is consolidated (Adam, larger layers)."""
    seed_everything(7)
    model = make_model(args, width=args.width, units=4, batches=1)
    trainer = make_trainer(args, max_epochs=1)
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
    trainer.fit(model)
    with PeakMemory() as meter:
        full = trainer.strategy.optimizer_state(trainer.optimizers[0])
    unit_params = args.width * args.width + args.width
    local_state = sum(
        t.numel() * t.element_size() for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim()
    )
    return {
        "rank": trainer.global_rank,
        "growth_mib": meter.result()["peak_extra_mb"],
        "unit_params_mib": unit_params * 4 / MIB,
        "unit_with_adam_state_mib": 3 * unit_params * 4 / MIB,
        "full_adam_state_mib": 2 * 4 * unit_params * 4 / MIB,
        "local_adam_state_mib": local_state / MIB,
        "full_keys": sorted(full),
    }


def test_from_checkpoint(args: argparse.Namespace) -> Dict[str, Any]:
    """``trainer.test(ckpt_path=...)`` restores the weights of a model built in ``configure_sharded_model``."""
    seed_everything(8)  # a different initialisation than the saved model's
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    trainer.test(model, ckpt_path=args.ckpt, verbose=False)
    return report(args, trainer, model)


def misuse(args: argparse.Namespace) -> Dict[str, Any]:
    """A misconfiguration that FairScale cannot consolidate: the first checkpoint must raise a clear error."""
    seed_everything(7)
    model_kwargs: Dict[str, Any] = {}
    strategy_kwargs: Dict[str, Any] = {}
    if args.case == "param_groups":
        model_kwargs["param_groups"] = 2
    elif args.case == "no_flatten":
        strategy_kwargs["flatten_parameters"] = False
    elif args.case == "outside_param":
        model_kwargs["extra_before"] = True
    model = make_model(args, **model_kwargs)
    trainer = make_trainer(args, max_epochs=1, **strategy_kwargs)
    try:
        trainer.fit(model)
    except MisconfigurationException as err:
        return {"rank": global_rank(), "error": str(err)}
    return {"rank": global_rank(), "error": None}


def make_legacy(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit one epoch and write a checkpoint shaped like upstream 1.6.5's: rank 0's local optimizer shard."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    trainer.fit(model)
    path = args.out / "ckpts" / "epoch=0.ckpt"
    local = local_optimizer_states(trainer)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        checkpoint["optimizer_states"] = local
        torch.save(checkpoint, args.out / "legacy.ckpt")
    trainer.strategy.barrier()
    return report(args, trainer, model)


def resume_legacy(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from a checkpoint of upstream 1.6.5's shape: a warning, the weights load, the optimizer state not."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=args.ckpt)
    messages = [str(w.message) for w in caught if "optimizer state" in str(w.message)]
    return report(args, trainer, model, warnings=messages)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--wrapping", default="wrap", choices=["wrap", "auto_wrap"])
    parser.add_argument("--min-num-params", type=int, default=100_000_000, help="of the strategy's auto_wrap policy")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--case", default=None, choices=["param_groups", "no_flatten", "outside_param"])


if __name__ == "__main__":
    main(
        {
            "fit": fit,
            "consolidate": consolidate,
            "misuse": misuse,
            "memory": memory,
            "test_from_checkpoint": test_from_checkpoint,
            "make_legacy": make_legacy,
            "resume_legacy": resume_legacy,
        },
        add_arguments,
    )
