"""A DDP resume on 2 CPU ranks (over gloo) from a checkpoint with one flipped bit, run as
``python -m tests.checkpointing.verified_load_scenarios``; driven by ``test_verified_load.py``."""
import argparse
from typing import Any, Dict

from fsdp_harness.corrupt_checkpoint import flip_bit, record_byte, record_of_keys
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.utilities.exceptions import CheckpointError
from tests.helpers.optimizer_models import AdamModel

SAVED_STEPS, RESUMED_STEPS = 2, 4
#: the key whose record gets the flipped bit
FLIPPED_KEY = "state_dict.layer.weight"


class CountTrainBatches(Callback):
    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self.started += 1


def _trainer(args: argparse.Namespace, **overrides: Any) -> Trainer:
    defaults = {"strategy": "ddp", "max_steps": SAVED_STEPS, "limit_val_batches": 0}
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **overrides}))


def ddp_flipped_bit(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit and save; global rank 0 flips one bit in the record of :data:`FLIPPED_KEY`; every rank resumes from the
    damaged copy (memory-mapped, each checking every record it reads whole) and records the ``CheckpointError`` it
    raised, the global step and the training batches that started."""
    seed_everything(1)
    good, bad = args.out / "good.ckpt", args.out / "flipped.ckpt"
    trainer = _trainer(args)
    trainer.fit(AdamModel())
    trainer.save_checkpoint(good)
    result: Dict[str, Any] = {"rank": trainer.global_rank, "error": None, "error_types": []}
    if trainer.global_rank == 0:
        record = record_of_keys(good)[FLIPPED_KEY]
        byte = record_byte(good, record, 0.5)
        flip_bit(good, bad, byte)
        result.update(record=record, byte=byte)
    trainer.strategy.barrier()

    count = CountTrainBatches()
    trainer = _trainer(args, max_steps=RESUMED_STEPS, callbacks=[count])
    try:
        trainer.fit(AdamModel(), ckpt_path=str(bad))
    except CheckpointError as ex:
        result.update(error=str(ex), error_types=[t.__name__ for t in type(ex).__mro__])
    result.update(global_step=trainer.global_step, train_batches=count.started)
    return result


if __name__ == "__main__":
    main({"ddp_flipped_bit": ddp_flipped_bit})
