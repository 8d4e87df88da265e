"""Safe loading on 2 CPU ranks (the fork/safe-checkpoint-load patch), run as
``python -m tests.checkpointing.safe_load_scenarios``; the driving test is in ``test_safe_load.py``."""
import argparse
import time
from pickle import UnpicklingError
from typing import Any, Dict

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.exceptions import CheckpointError
from tests.helpers.malicious_checkpoint import make_malicious_checkpoint


def _trainer(args: argparse.Namespace, **overrides: Any) -> Trainer:
    defaults = {"strategy": CPUFullyShardedStrategy(), "max_steps": 2, "limit_val_batches": 0}
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **overrides}))


def _model() -> FSDPModel:
    return FSDPModel(width=8, units=2, batches=2)


def refuse_then_resume(args: argparse.Namespace) -> Dict[str, Any]:
    """Save, let global rank 0 add a payload to a copy of the file, resume from that copy with the default
    ``weights_only`` (every rank must refuse it), load it with ``cloud_io.load`` and ``TorchCheckpointIO`` on every
    rank, then resume from the good file (every rank must resume)."""
    good, bad, marker = args.out / "good.ckpt", args.out / "bad.ckpt", args.out / "PAYLOAD_RAN"
    trainer = _trainer(args)
    trainer.fit(_model())
    trainer.save_checkpoint(good)
    if trainer.is_global_zero:
        make_malicious_checkpoint(good, bad, marker)
    trainer.strategy.barrier()

    trainer = _trainer(args, max_steps=4)
    start = time.monotonic()
    result: Dict[str, Any] = {"rank": trainer.global_rank, "raised": None}
    try:
        trainer.fit(_model(), ckpt_path=str(bad))
    except CheckpointError as error:
        unpickling = isinstance(error, UnpicklingError)
        result.update(raised=type(error).__qualname__, message=str(error), unpickling=unpickling)
    result["seconds"] = time.monotonic() - start
    # the other load paths, on every rank
    result["other_paths"] = []
    for load in (lambda: pl_load(str(bad)), lambda: TorchCheckpointIO().load_checkpoint(bad)):
        try:
            load()
            result["other_paths"].append("loaded")
        except CheckpointError as error:
            result["other_paths"].append(type(error).__qualname__)

    trainer = _trainer(args, max_steps=4)
    trainer.fit(_model(), ckpt_path=str(good))
    result["resumed_global_step"] = trainer.global_step
    return result


if __name__ == "__main__":
    main({"refuse_then_resume": refuse_then_resume})
