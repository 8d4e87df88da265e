"""Safe loading on 2 CPU ranks (the fork/safe-checkpoint-load patch), run as
``python -m tests.checkpointing.safe_load_scenarios``; the driving tests are in ``test_safe_load.py``."""
import argparse
import time
from pickle import UnpicklingError
from typing import Any, Dict

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.utilities.exceptions import CheckpointError


def _trainer(args: argparse.Namespace, **overrides: Any) -> Trainer:
    defaults = {"strategy": CPUFullyShardedStrategy(), "max_steps": 2, "limit_val_batches": 0}
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **overrides}))


def save(args: argparse.Namespace) -> Dict[str, Any]:
    trainer = _trainer(args)
    trainer.fit(FSDPModel(width=8, units=2, batches=2))
    trainer.save_checkpoint(args.out / "good.ckpt")
    return {"rank": trainer.global_rank}


def resume(args: argparse.Namespace) -> Dict[str, Any]:
    """``fit(ckpt_path=args.ckpt)`` with ``args.weights_only``; reports what each rank raised."""
    weights_only = {"default": None, "true": True, "false": False}[args.weights_only]
    trainer = _trainer(args, max_steps=4)
    start = time.monotonic()
    result: Dict[str, Any] = {"rank": trainer.global_rank, "raised": None}
    try:
        trainer.fit(FSDPModel(width=8, units=2, batches=2), ckpt_path=args.ckpt, weights_only=weights_only)
    except CheckpointError as error:
        result.update(raised=type(error).__qualname__, message=str(error), unpickling=isinstance(error, UnpicklingError))
    result["seconds"] = time.monotonic() - start
    result["global_step"] = trainer.global_step
    return result


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt")
    parser.add_argument("--weights-only", default="default", choices=["default", "true", "false"])


if __name__ == "__main__":
    main({"save": save, "resume": resume}, _arguments)
