"""The decision whether every rank can write the one checkpoint file (``checkpoint_writers``), on 2 CPU FSDP ranks over
gloo: ``python -m tests.strategies.fsdp_writer_decision_scenarios batch --cases FILE``; driven by
``test_ddp_fully_sharded_writer_decision.py``.

The first case trains a small FSDP model for one step, which sets up the strategy and its gloo checkpoint group; every
case then calls ``_decide_checkpoint_writers`` on that strategy for a temporary file in ``--dir``, with
``--requested``:

- ``--node-local OTHER``: global rank 1 sees ``OTHER`` at ``--dir`` (a mount namespace of its own with ``OTHER``
  bind-mounted over ``--dir``, see ``tests/helpers/mount_namespace.py``), as a rank on another node sees node-local
  scratch mounted at the same path on every node;
- ``--fake-mounts PROC``: global rank 1 reads its mount table from the fake ``/proc`` at ``PROC`` (made by the test
  with ``tests/helpers/fake_proc.py``), where ``--dir`` is on a FUSE mount of an object store;
- ``--twice``: the decision is made twice, as for two saves.

Every rank records each decision (or the exception it raised), the info lines Lightning logged on it, and what
``--dir`` holds afterwards, as this rank sees it.
"""
import argparse
import logging
import os
from typing import Any, Dict, List, Optional, Set

import psutil

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.strategies.fsdp_writer_decision import _decide_checkpoint_writers
from tests.helpers.mount_namespace import see_other_directory_at

_TRAINER: Optional[Trainer] = None
#: the directories this process already sees another directory at (a later case may name the same)
_NODE_LOCAL: Set[str] = set()


def _strategy(args: argparse.Namespace) -> CPUFullyShardedStrategy:
    """The strategy of one short ``fit``, made by the first case: every case of a batch runs in the same processes."""
    global _TRAINER
    if _TRAINER is None:
        seed_everything(1)
        trainer = Trainer(
            **quiet_trainer_kwargs(
                args.out, args.devices, strategy=CPUFullyShardedStrategy(), max_steps=1, limit_val_batches=0
            )
        )
        trainer.fit(FSDPModel(width=8, units=1, batches=1))
        _TRAINER = trainer
    return _TRAINER.strategy


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _decide(strategy: CPUFullyShardedStrategy, args: argparse.Namespace) -> Dict[str, Any]:
    try:
        writers, reason = _decide_checkpoint_writers(strategy, os.path.join(args.dir, "last.ckpt.tmp"), args.requested)
    except Exception as ex:
        return {"raised": type(ex).__name__, "message": str(ex)}
    return {"writers": writers, "reason": reason}


def decide(args: argparse.Namespace) -> Dict[str, Any]:
    strategy = _strategy(args)
    if args.node_local and strategy.global_rank == 1 and args.dir not in _NODE_LOCAL:
        see_other_directory_at(args.dir, args.node_local)
        _NODE_LOCAL.add(args.dir)
    fake_mounts = args.fake_mounts and strategy.global_rank == 1
    procfs = psutil.PROCFS_PATH
    lines = LogLines()
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(lines)
    try:
        if fake_mounts:
            psutil.PROCFS_PATH = args.fake_mounts
        decisions = [_decide(strategy, args) for _ in range(2 if args.twice else 1)]
    finally:
        psutil.PROCFS_PATH = procfs
        logger.removeHandler(lines)
    strategy.barrier()  # global rank 0 has removed the probe file before any rank lists the directory
    left = sorted(os.listdir(args.dir))
    # and no rank writes the next case's probe file into it before every rank has listed it
    strategy.barrier()
    return {
        "rank": strategy.global_rank,
        "decisions": decisions,
        "info": [line for line in lines.lines if "checkpoint_writers" in line],
        "left": left,
    }


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="the checkpoint directory")
    parser.add_argument("--requested", choices=["auto", "all", "rank0"], required=True)
    parser.add_argument("--node-local", help="the directory global rank 1 sees at --dir")
    parser.add_argument("--fake-mounts", help="the fake /proc global rank 1 reads its mount table from")
    parser.add_argument("--twice", action="store_true")


if __name__ == "__main__":
    main({"decide": decide}, _arguments)
