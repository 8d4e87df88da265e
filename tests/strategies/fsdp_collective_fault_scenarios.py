"""Faults inside the per-unit loops of FSDP checkpointing, on CPU FSDP (2 ranks over gloo):
``python -m tests.strategies.fsdp_collective_fault_scenarios <loop> --fail-rank R --out DIR``.

Each scenario fits ``FSDPModel`` (3 FSDP units) for one step, saves a good checkpoint, then makes the ``--fail-on``-th
per-unit local operation of one loop raise on global rank ``--fail-rank`` only:

- ``state_dict_memory``: the host-memory check before the state-dict gather finds no memory available (a fake
  ``/proc/meminfo`` with ``MemAvailable: 0 kB``, see ``tests/helpers/fake_proc.py``);
- ``state_dict``: FairScale's ``_post_state_dict_hook`` (patched before the model is wrapped, since FSDP binds it
  with ``functools.partial`` when it is constructed), during ``trainer.save_checkpoint``;
- ``optimizer``: the optimizer-state consolidation, during ``trainer.save_checkpoint``: on rank 0 the per-unit
  ``get_param_views`` (of the FlattenParamsWrapper), elsewhere the per-unit move of the unit's optimizer state to the
  gather device;
- ``load``: ``torch.Tensor.copy_`` of the per-unit model load, during ``fit(ckpt_path=...)``;
- ``reshard``: the re-sharding of the optimizer state into each flat parameter (``_shard_of_pieces``), during
  ``fit(ckpt_path=...)``.

Every rank catches what escapes and writes, to ``<out>/rank<N>.json``, the type, message and cause of the error and
the seconds from the start of the faulty save or load (after a barrier) to the raise. Rank 0 records the sha256 of
the previous checkpoint before and after. Driven by ``test_ddp_fully_sharded_collective_faults.py``.
"""
import argparse
import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any, Callable, Dict
from unittest import mock

import torch

import pytorch_lightning.strategies.fsdp_optimizer_state as fsdp_optimizer_state
import pytorch_lightning.strategies.fsdp_portable_optimizer_state as portable
import pytorch_lightning.utilities.host_memory as host_memory
from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import end_process_groups, global_rank, main, quiet_trainer_kwargs
from pytorch_lightning import Trainer, seed_everything
from tests.helpers.fake_proc import FakeProc

UNITS = 3


class InjectedFault(RuntimeError):
    pass


class Fault:
    """Counts the calls of one per-unit operation while armed, and raises on the ``fail_on``-th on ``fail_rank``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.fail_rank, self.fail_on = args.fail_rank, args.fail_on
        self.enabled, self.armed, self.calls, self.raised_at = False, False, 0, None

    def wrap(self, original: Callable) -> Callable:
        def faulty(*args: Any, **kwargs: Any) -> Any:
            if self.armed and global_rank() == self.fail_rank:
                self.calls += 1
                if self.calls == self.fail_on:
                    self.raised_at = self.calls
                    raise InjectedFault(f"injected fault in call {self.calls} of {original.__name__}")
            return original(*args, **kwargs)

        faulty.__name__ = getattr(original, "__name__", "faulty")
        return faulty


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _outcome(start: float, error: BaseException) -> Dict[str, Any]:
    cause = error.__cause__
    return {
        "raised": True,
        "seconds": time.monotonic() - start,
        "type": f"{type(error).__module__}.{type(error).__qualname__}",
        "mro": [c.__name__ for c in type(error).__mro__],
        "message": str(error),
        "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
    }


def _trainer(args: argparse.Namespace, **kwargs: Any) -> Trainer:
    defaults = {"strategy": CPUFullyShardedStrategy(), "max_epochs": 1, "limit_val_batches": 0}
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **kwargs}))


def _model() -> FSDPModel:
    return FSDPModel(width=8, units=UNITS, batches=1)


def save_side(args: argparse.Namespace) -> Dict[str, Any]:
    fault = Fault(args)
    if args.loop == "state_dict_memory":
        fake_proc = FakeProc(args.out / f"fake-rank{global_rank()}")
        fake_proc.set_mem_available(0)  # too little even for this small model's state dict
    elif args.loop == "state_dict":
        from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

        fsdp_module._post_state_dict_hook = fault.wrap(fsdp_module._post_state_dict_hook)
    elif global_rank() == 0:
        # FullyShardedDataParallel forwards ``get_param_views`` to its FlattenParamsWrapper
        from fairscale.nn.misc import FlattenParamsWrapper

        FlattenParamsWrapper.get_param_views = fault.wrap(FlattenParamsWrapper.get_param_views)
    elif global_rank() == args.fail_rank:
        fsdp_optimizer_state._optimizer_state_to_gather_device = fault.wrap(
            fsdp_optimizer_state._optimizer_state_to_gather_device
        )
    seed_everything(1)
    # the loops of the gathered save; the streamed one's faults: ``fsdp_stream_scenarios.fails_while_streaming``
    strategy = CPUFullyShardedStrategy(stream_checkpoint=False)
    if args.loop == "optimizer":
        # FairScale also calls ``get_param_views`` while gathering the state dict: count the consolidation's only
        original_state = strategy.optimizer_state

        def optimizer_state(optimizer: Any) -> Dict[str, Any]:
            fault.armed = fault.enabled
            try:
                return original_state(optimizer)
            finally:
                fault.armed = False

        strategy.optimizer_state = optimizer_state
    trainer = _trainer(args, strategy=strategy)
    trainer.fit(_model())
    path = args.out / "ckpts" / "model.ckpt"
    path.parent.mkdir(exist_ok=True)
    # weights only: a full save over it that went through would change the file
    trainer.save_checkpoint(path, weights_only=True)
    trainer.strategy.barrier()
    before = sha256(path)
    fault.enabled = True
    fault.armed = args.loop in ("state_dict", "state_dict_memory")
    if args.loop == "state_dict_memory" and global_rank() == fault.fail_rank:
        host_memory.PROC_ROOT, fault.raised_at = str(fake_proc.proc), 1
    start = time.monotonic()
    result: Dict[str, Any] = {"rank": trainer.global_rank, "raised": False}
    try:
        trainer.save_checkpoint(path)
        result["seconds"] = time.monotonic() - start
    except Exception as error:
        result = {"rank": trainer.global_rank, **_outcome(start, error)}
    fault.armed = False
    result.update(before=before, after=sha256(path), files=sorted(p.name for p in path.parent.iterdir()))
    result["fault_raised_at"] = fault.raised_at
    return result


def load_side(args: argparse.Namespace) -> Dict[str, Any]:
    fault = Fault(args)
    seed_everything(1)
    trainer = _trainer(args)
    trainer.fit(_model())
    path = args.out / "ckpts" / "model.ckpt"
    path.parent.mkdir(exist_ok=True)
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()

    strategy = CPUFullyShardedStrategy()
    start = [0.0]
    if args.loop == "load":
        original_load = strategy.load_model_state_dict
        original_copy = torch.Tensor.copy_

        def load_model_state_dict(checkpoint: Any) -> None:
            torch.Tensor.copy_ = fault.wrap(original_copy)
            fault.armed, start[0] = True, time.monotonic()
            try:
                original_load(checkpoint)
            finally:
                fault.armed, torch.Tensor.copy_ = False, original_copy

        strategy.load_model_state_dict = load_model_state_dict
    else:
        original_opt_load = strategy.load_optimizer_state_dict

        def load_optimizer_state_dict(checkpoint: Any) -> None:
            fault.armed, start[0] = True, time.monotonic()
            try:
                original_opt_load(checkpoint)
            finally:
                fault.armed = False

        strategy.load_optimizer_state_dict = load_optimizer_state_dict
        portable._shard_of_pieces = fault.wrap(portable._shard_of_pieces)
    trainer = _trainer(args, strategy=strategy, max_epochs=2)
    result: Dict[str, Any] = {"rank": trainer.global_rank, "raised": False}
    try:
        trainer.fit(_model(), ckpt_path=str(path))
    except Exception as error:
        result = {"rank": trainer.global_rank, **_outcome(start[0], error)}
    result["fault_raised_at"] = fault.raised_at
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--fail-on", type=int, default=2, help="which per-unit call fails (1-based)")


def _patched_attributes() -> Any:
    """What the scenarios replace for their faults: restored after each, so that the next scenario of a batch
    (``fsdp_harness.runner.ScenarioBatch``) starts from the real ones."""
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module
    from fairscale.nn.misc import FlattenParamsWrapper

    stack = contextlib.ExitStack()
    for owner, name in (
        (fsdp_module, "_post_state_dict_hook"),
        (FlattenParamsWrapper, "get_param_views"),
        (fsdp_optimizer_state, "_optimizer_state_to_gather_device"),
        (portable, "_shard_of_pieces"),
        (host_memory, "PROC_ROOT"),
        (torch.Tensor, "copy_"),
    ):
        stack.enter_context(mock.patch.object(owner, name, getattr(owner, name)))
    return stack


if __name__ == "__main__":
    scenarios = {}
    for loop, run in (
        ("state_dict", save_side),
        ("state_dict_memory", save_side),
        ("optimizer", save_side),
        ("load", load_side),
        ("reshard", load_side),
    ):

        def scenario(args: argparse.Namespace, loop: str = loop, run: Callable = run) -> Dict[str, Any]:
            args.loop = loop
            with _patched_attributes():
                result = run(args)
            # tear the process groups (the default one and the checkpoint group) down while every rank is here: left
            # to the interpreter's exit, gloo once aborted a rank ("terminate called without an active exception")
            end_process_groups()
            return result

        scenarios[loop] = scenario
    main(scenarios, add_arguments)
