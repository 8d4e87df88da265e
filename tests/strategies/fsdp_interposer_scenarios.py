"""The FairScale interposer of ``fsdp_guarded_gathers`` in real saves on CPU FSDP (2 ranks over gloo):
``python -m tests.strategies.fsdp_interposer_scenarios interposer --out DIR [--cases ...]``.

FairScale 0.4.13 passes ``group=`` as a keyword everywhere; :class:`PositionalFairScale` emulates a FairScale whose
``_rebuild_full_params`` passes it positionally, through its module global ``dist`` as FairScale does, before the
original, and lets one rank run out of memory before that collective. The cases, in one launch:

- ``thread``: at the first unit of a save, another thread tries to guard FairScale's collectives too;
- ``swap``: at the first unit of a save, something else replaces FairScale's global ``dist`` (as a profiler might);
- ``positional``: streamed and gathered saves, global rank 0 or 1 runs out of memory at the middle unit, right
  before the positional collective that the other rank is about to enter;
- ``setup``: last, a FairScale that lacks ``FullyShardedDataParallel._free_fp16_param_shard``; ``fit`` must fail at
  setup, naming the installed FairScale version.

Every rank writes ``<out>/rank<N>.json``. Driven by ``test_ddp_fully_sharded_interposer.py``.
"""
import argparse
import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Generator, Optional

import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from pytorch_lightning import seed_everything, Trainer
from pytorch_lightning.strategies.fsdp_guarded_gathers import _agreeing_fairscale_collectives
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard
from tests.strategies.fsdp_collective_fault_scenarios import _outcome

UNITS = 3
CASES = ("thread", "swap", "positional", "setup")


class PositionalFairScale:
    """While armed, FairScale's ``_rebuild_full_params`` of a unit with parameters first calls
    ``dist.all_reduce(tensor, ReduceOp.SUM, self.process_group)`` through FairScale's module global; on global rank
    ``fail_rank`` it raises ``MemoryError`` instead at its ``fail_on``-th call. ``at_first_unit`` runs at the first
    call of a save, inside the strategy's guarded loop."""

    def __init__(self) -> None:
        self.armed = False
        self.fail_rank: Optional[int] = None
        self.fail_on, self.calls, self.positional_calls = 0, 0, 0
        self.at_first_unit: Optional[Callable[[FullyShardedDataParallel], None]] = None
        original = FullyShardedDataParallel._rebuild_full_params

        def rebuild(instance: FullyShardedDataParallel, *args: Any, **kwargs: Any) -> Any:
            if self.armed and instance.params:
                self.calls += 1
                if self.calls == 1 and self.at_first_unit is not None:
                    self.at_first_unit(instance)
                if self.fail_rank == global_rank() and self.calls == self.fail_on:
                    raise MemoryError(f"CUDA out of memory. Tried to allocate 64.00 MiB (injected: unit {self.calls})")
                fsdp_module.dist.all_reduce(torch.zeros(1), torch.distributed.ReduceOp.SUM, instance.process_group)
                self.positional_calls += 1
            return original(instance, *args, **kwargs)

        FullyShardedDataParallel._rebuild_full_params = rebuild

    @contextlib.contextmanager
    def arm(
        self, fail_rank: Optional[int] = None, at_first_unit: Optional[Callable] = None
    ) -> Generator[None, None, None]:
        self.armed, self.fail_rank, self.fail_on, self.calls = True, fail_rank, 2, 0
        self.at_first_unit = at_first_unit
        try:
            yield
        finally:
            self.armed, self.at_first_unit = False, None


def _save(trainer: Trainer, path: Path) -> Dict[str, Any]:
    trainer.strategy.barrier()
    start = time.monotonic()
    try:
        trainer.save_checkpoint(path)
    except Exception as error:
        return _outcome(start, error)
    return {"raised": False}


def _second_thread_guard(record: Dict[str, Any]) -> Callable[[FullyShardedDataParallel], None]:
    """At the first unit: a thread of its own tries to guard FairScale's collectives while this thread does."""

    def attempt(instance: FullyShardedDataParallel) -> None:
        before = fsdp_module.dist
        try:
            with _agreeing_fairscale_collectives(_CollectiveGuard(lambda failed: []), instance.process_group):
                record["raised"] = False
        except RuntimeError as error:
            record.update(raised=True, message=str(error))
        record["global_kept"] = fsdp_module.dist is before

    def at_first_unit(instance: FullyShardedDataParallel) -> None:
        thread = threading.Thread(target=attempt, args=(instance,))
        thread.start()
        thread.join()

    return at_first_unit


class _ForeignDistributed:
    """Another wrapper of FairScale's global, installed in the middle of a save."""

    def __init__(self, dist: Any) -> None:
        self._dist = dist

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)


def _swap_global(instance: FullyShardedDataParallel) -> None:
    fsdp_module.dist = _ForeignDistributed(fsdp_module.dist)


def _guarded_cases(args: argparse.Namespace, fairscale: PositionalFairScale) -> Dict[str, Any]:
    """The thread, swap and positional cases, on one fitted model; each followed by a save that must succeed."""
    result: Dict[str, Any] = {}
    for stream in (True, False):
        seed_everything(1)
        trainer = Trainer(
            **quiet_trainer_kwargs(
                args.out,
                args.devices,
                # FairScale's gathers are in a save that global rank 0 writes alone: every rank writing its own
                # shards (the default ``"auto"`` on one host) gathers no unit
                strategy=CPUFullyShardedStrategy(stream_checkpoint=stream, checkpoint_writers="rank0"),
                max_epochs=1,
            )
        )
        trainer.fit(FSDPModel(width=8, units=UNITS, batches=1))
        path = args.out / "ckpts" / f"model-{stream}.ckpt"
        path.parent.mkdir(exist_ok=True)
        layout = "streamed" if stream else "gathered"
        if "thread" in args.cases:
            record: Dict[str, Any] = {}
            with fairscale.arm(at_first_unit=_second_thread_guard(record)):
                record["save"] = _save(trainer, path)
            result[f"thread-{layout}"] = record
        if "swap" in args.cases:
            original = fsdp_module.dist
            with fairscale.arm(at_first_unit=_swap_global):
                record = _save(trainer, path)
            record["restored"] = fsdp_module.dist is original
            fsdp_module.dist = original
            record["retry"] = _save(trainer, path)
            result[f"swap-{layout}"] = record
        if "positional" in args.cases:
            for fail_rank in (0, 1):
                with fairscale.arm(fail_rank=fail_rank):
                    record = _save(trainer, path)
                record.update(fail_rank=fail_rank, positional_calls=fairscale.positional_calls)
                record["retry"] = _save(trainer, path)
                result[f"positional-{layout}-rank{fail_rank}"] = record
    return result


def _setup_case(args: argparse.Namespace) -> Dict[str, Any]:
    """``fit`` with a FairScale that lacks a method the interposer calls: it fails at setup, before training."""
    missing = FullyShardedDataParallel._free_fp16_param_shard
    del FullyShardedDataParallel._free_fp16_param_shard
    model = FSDPModel(width=8, units=UNITS, batches=1)
    trainer = Trainer(**quiet_trainer_kwargs(args.out, args.devices, strategy=CPUFullyShardedStrategy(), max_epochs=1))
    start = time.monotonic()
    try:
        trainer.fit(model)
        record: Dict[str, Any] = {"raised": False}
    except Exception as error:
        record = _outcome(start, error)
    finally:
        FullyShardedDataParallel._free_fp16_param_shard = missing
    record["trained_steps"] = trainer.global_step
    return record


def interposer(args: argparse.Namespace) -> Dict[str, Any]:
    fairscale = PositionalFairScale()
    result = _guarded_cases(args, fairscale)
    if "setup" in args.cases:
        result["setup"] = _setup_case(args)
    return result


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES))


if __name__ == "__main__":
    main({"interposer": interposer}, _add_arguments)
