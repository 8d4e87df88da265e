"""Resume a ``ckpt_path`` under DDP (2 CPU ranks over gloo) or on one device, with the layers made in
``configure_sharded_model`` or in ``__init__``, and validate from a file the fork's FSDP wrote; run as
``python -m tests.checkpointing.restore_order_scenarios``, or in-process for one device. The driving tests are in
``test_restore_order.py``."""
import argparse
import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional

import torch

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
from tests.helpers.optimizer_models import AdamModel
from tests.helpers.resume_check import RecordOnTrainStart, state_mismatches

EPOCH_STEPS = 4


class RecordsHooks:
    """Mixin for a LightningModule: ``calls`` lists, in order, the hooks that build and restore the model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: List[str] = []

    def setup(self, stage: Optional[str] = None) -> None:
        self.calls.append("setup")
        super().setup(stage)

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.calls.append("on_load_checkpoint")
        super().on_load_checkpoint(checkpoint)

    def configure_sharded_model(self) -> None:
        self.calls.append("configure_sharded_model")
        super().configure_sharded_model()

    def configure_optimizers(self):
        self.calls.append("configure_optimizers")
        return super().configure_optimizers()


class ShardedLayers(RecordsHooks, FSDPModel):
    """Its blocks exist only after ``configure_sharded_model`` (outside FSDP, ``wrap`` returns them as they are),
    trained with Adam."""

    def __init__(self, units: int = 2) -> None:
        super().__init__(width=16, units=units, optimizer="adam", batches=EPOCH_STEPS)


class PlainLayers(RecordsHooks, AdamModel):
    """Its layer exists from ``__init__``, as in most models."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # EPOCH_STEPS batches per rank on 2 ranks, as ShardedLayers
        return torch.utils.data.DataLoader(torch.randn(EPOCH_STEPS * 2 * 2, 32), batch_size=2)


MODELS = {"sharded": ShardedLayers, "plain": PlainLayers}


class CountingCheckpointIO(TorchCheckpointIO):
    """Counts the checkpoint files it loads."""

    loads = 0

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage) -> Dict[str, Any]:
        self.loads += 1
        return super().load_checkpoint(path, map_location=map_location)


@contextlib.contextmanager
def lightning_messages() -> Iterator[List[str]]:
    """The messages that Lightning's loggers (``rank_zero_info`` and the like) log inside the block."""
    messages: List[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _trainer(args: argparse.Namespace, epochs: int, **options: Any) -> Trainer:
    strategy = "ddp" if args.devices > 1 else None
    kwargs = quiet_trainer_kwargs(args.out, args.devices, strategy=strategy, max_epochs=epochs, limit_val_batches=0)
    return Trainer(**{**kwargs, **options})


def _fit(args: argparse.Namespace, epochs: int, ckpt_path: Optional[Path] = None) -> SimpleNamespace:
    """A fit of a new model from the same seed (the same layers and data every time), and what it recorded."""
    seed_everything(1)
    run = SimpleNamespace(model=MODELS[args.model](), record=RecordOnTrainStart(), io=CountingCheckpointIO())
    # the record's attributes hide the callback's `state_dict`: a fit that saves cannot have it
    callbacks = [run.record] if ckpt_path else []
    run.trainer = _trainer(args, epochs, callbacks=callbacks, plugins=[run.io])
    with lightning_messages() as run.messages:
        run.trainer.fit(run.model, ckpt_path=ckpt_path)
    return run


def resume(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit one epoch and save; then fit two epochs from scratch, and two from the checkpoint: the resumed fit must
    restore the saved model and Adam state, load the file once, and end where the uninterrupted one does."""
    path = args.out / "model.ckpt"
    first = _fit(args, 1)
    first.trainer.save_checkpoint(path)
    first.trainer.strategy.barrier()  # the file is complete before any rank loads it
    uninterrupted = _fit(args, 2)
    resumed = _fit(args, 2, ckpt_path=path)

    saved = torch.load(path, map_location="cpu", weights_only=False)
    return {
        "rank": resumed.trainer.global_rank,
        "global_step": resumed.trainer.global_step,
        "calls": resumed.model.calls,
        "loads": resumed.io.loads,
        "order_messages": [m for m in resumed.messages if "after `configure_sharded_model`" in m],
        "model_mismatches": state_mismatches(resumed.record.state_dict, saved["state_dict"]),
        "optimizer_mismatches": state_mismatches(resumed.record.optimizer_state, saved["optimizer_states"][0]),
        "optimizer_state_tensors": sum(len(s) for s in saved["optimizer_states"][0]["state"].values()),
        "final_mismatches": state_mismatches(resumed.model.state_dict(), uninterrupted.model.state_dict()),
    }


def validate_from(args: argparse.Namespace, path: Path) -> Dict[str, Any]:
    """``trainer.validate`` a new :class:`ShardedLayers` from ``path`` (here or in the process that calls it): the
    weights it evaluated and the order of its hooks."""
    model = ShardedLayers()
    trainer = _trainer(args, 1, limit_val_batches=2)
    trainer.validate(model, ckpt_path=str(path))
    saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {"calls": model.calls, "model_mismatches": state_mismatches(model.state_dict(), saved)}


def fsdp_weights(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit :class:`ShardedLayers` under the fork's FSDP and save, then validate a new one from that file under DDP."""
    seed_everything(1)
    path = args.out / "fsdp.ckpt"
    kwargs = quiet_trainer_kwargs(args.out, args.devices, strategy=CPUFullyShardedStrategy(), max_epochs=1,
                                  limit_val_batches=0)
    trainer = Trainer(**kwargs)
    trainer.fit(ShardedLayers())
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    return validate_from(args, path)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS))


def in_process(out: Path, model: str) -> Dict[str, Any]:
    """:func:`resume` on one device, in this process."""
    return resume(argparse.Namespace(out=out, devices=1, model=model))


if __name__ == "__main__":
    main({"resume": resume, "fsdp_weights": fsdp_weights}, _add_arguments)
