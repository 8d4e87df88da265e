"""Multi-process scenarios of the CRC-32 fields of FSDP checkpoint files on CPU, run as
``python -m tests.strategies.fsdp_record_crc_scenarios``; driven by ``test_ddp_fully_sharded_record_crcs.py``.

``saves`` fits the tied-weights model once and saves the same state once per ``--saves`` mode, each into
``<out>/<mode>.ckpt``:

- ``async-rank0`` and ``async-all``: at the end of the last epoch of ``fit`` (``async_checkpoint=True``), in the
  background, written by global rank 0 alone (``checkpoint_writers="rank0"``) or by every rank, its own shards
  (``"all"``); each is waited for (``wait_for_checkpoint``) before the next;
- ``rank0``, ``all`` and ``gathered``: after ``fit``, synchronously: the streamed save of global rank 0 alone, the
  parallel save, and the gathered save (``stream_checkpoint=False``, ``torch.save`` of the full state).

``checkpoint_writers`` and ``stream_checkpoint`` are read at every save, so one ``Trainer`` makes every save of a
rank's case. Every rank records, for each save, how many streamed files it wrote the structure of (global rank 0:
one per streamed save), whether the save went to the background and how many times it sent global rank 0 the CRC-32s
of the pieces it wrote (the parallel save's exchange, from the writer thread in the background); the test reads the
files themselves.
"""
import argparse
from typing import Any, Dict, List

from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.strategies import fsdp_parallel_save
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile
from tests.strategies.fsdp_parallel_save_scenarios import counting_calls
from tests.strategies.fsdp_stream_scenarios import strategy, TiedFSDPModel

#: the modes of ``--saves``; those saved in the background inside ``fit``, with their ``checkpoint_writers``
SAVES = ("async-rank0", "async-all", "rank0", "all", "gathered")
IN_FIT = {"async-rank0": "rank0", "async-all": "all"}
AFTER_FIT = {"rank0": "rank0", "all": "all", "gathered": "rank0"}


def save(trainer: Trainer, args: argparse.Namespace, mode: str, writers: str, stream: bool) -> Dict[str, Any]:
    """Save ``<out>/<mode>.ckpt`` with ``writers`` (streamed or not) and wait for it; what this rank saw of it."""
    trainer.strategy.checkpoint_writers = writers
    trainer.strategy.stream_checkpoint = stream
    skeletons: List[int] = []
    exchanges: List[int] = []
    with counting_calls(_StreamedCheckpointFile, "write_skeleton", skeletons), counting_calls(
        fsdp_parallel_save, "_send_crcs_to_writer", exchanges
    ):
        trainer.save_checkpoint(args.out / f"{mode}.ckpt")
        in_background = trainer.strategy._checkpoint_state.in_flight is not None
        trainer.strategy.wait_for_checkpoint()
    return {"streamed_files": len(skeletons), "in_background": in_background, "crc_exchanges": len(exchanges)}


class SaveInTheBackground(Callback):
    """At the end of the last epoch, the saves of ``IN_FIT`` that ``args.saves`` asks for."""

    def __init__(self, args: argparse.Namespace, saves: Dict[str, Any]) -> None:
        self.args, self.saves = args, saves

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.current_epoch != trainer.max_epochs - 1:
            return
        for mode in self.args.saves:
            if mode in IN_FIT:
                self.saves[mode] = save(trainer, self.args, mode, IN_FIT[mode], stream=True)
        trainer.strategy.stream_checkpoint = True


def saves(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit, saving in the background at the end (the ``IN_FIT`` modes of ``args.saves``), then save synchronously
    (the ``AFTER_FIT`` ones); see the module's docstring."""
    seed_everything(7)
    # width 72: a weight's record spans several 4 KiB blocks, and the ranks' shards end inside records and blocks
    model = TiedFSDPModel(
        width=72, units=3, wrapping="wrap", extra_before=True, extra_after=True, optimizer=args.optimizer,
        scheduler=True, batches=2,
    )
    in_fit = any(mode in IN_FIT for mode in args.saves)
    result: Dict[str, Any] = {"saves": {}}
    trainer = Trainer(
        **quiet_trainer_kwargs(
            args.out, args.devices, strategy=strategy(args, async_checkpoint=in_fit), max_epochs=1,
            limit_val_batches=0, num_sanity_val_steps=0, callbacks=[SaveInTheBackground(args, result["saves"])],
        )
    )
    trainer.fit(model)
    for mode in args.saves:
        if mode in AFTER_FIT:
            result["saves"][mode] = save(trainer, args, mode, AFTER_FIT[mode], stream=mode != "gathered")
    result["rank"] = trainer.global_rank
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--saves", nargs="+", choices=SAVES, default=list(SAVES))


if __name__ == "__main__":
    main({"saves": saves}, add_arguments)
