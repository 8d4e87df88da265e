"""Failures inside FairScale's own per-unit gathers, at the allocations around them, and a slow disk on global rank 0,
on CPU FSDP (2 ranks over gloo): ``python -m tests.strategies.fsdp_gather_fault_scenarios <scenario> --out DIR``.

- ``streamed`` / ``gathered``: FairScale's ``FullyShardedDataParallel._rebuild_full_params`` (which allocates a
  unit's full-parameter buffer, then all-gathers into it) raises ``MemoryError``, as a CUDA OOM there does, on one
  rank, at the first, the middle or the last of the ``UNITS`` FSDP units, during a streamed save or a gathered save
  (``stream_checkpoint=False``). All six cases (rank 0 and 1, three units) run one after the other in the same
  processes: after each failure the next save must succeed, with the same values.
- ``load``: the same six cases in ``fit(ckpt_path=...)``'s load of the model state: on one rank, torch's copy into the
  parameters of the first, middle or last unit (its shard, or its gathered full parameters where the load gathers
  the units) raises ``MemoryError`` inside torch's dispatch, as a CUDA OOM of the copy's staging buffer does. The load
  has no collective left that the other rank could wait in: it must still raise on every rank.
- ``allocations``: the allocations around the optimizer-state gathers fail: rank 0's receive buffers
  (``torch.empty_like``), and a rank's move of its state to the gather device (``Tensor.to``) after which the
  device stays out of memory (every later ``torch.zeros``/``zeros_like``/``empty``/``empty_like``/``Tensor.to``/
  ``Tensor.new_zeros`` on that rank raises too, so a placeholder allocated after the OOM would raise past the
  guard); gathered and streamed, and with ``cpu_offload=True``.
- ``outside_loop``: a callback's ``state_dict`` raises on one rank during a gathered save, after the model's gather
  and before the optimizer state's: the failing rank goes to the save's final exchange while the others are in the
  optimizer-state loop.
- ``slow_write``: the FSDP process groups get a timeout of ``FSDP_GROUP_SECONDS`` (they set none, so on GPUs they
  have NCCL's default, ten minutes, after which the watchdog ends the job), and one ``pwrite`` of global rank 0
  during a streamed save sleeps ``SLOW_WRITE_SECONDS``: the other rank must wait for it on the checkpoint group
  (``PL_CHECKPOINT_TIMEOUT``), not in the next gather on the FSDP group. The groups that FairScale caches
  process-wide are created afresh for it (with that timeout) and the ones from before put back after it, so that it
  can run in a batch after the other scenarios.

Every rank writes ``<out>/rank<N>.json`` with one outcome per case (see ``fsdp_collective_fault_scenarios._outcome``)
plus, on rank 0, the sha256 of the previous checkpoint after the case and the files of the checkpoint folder.
Driven by ``test_ddp_fully_sharded_gather_faults.py``.
"""
import argparse
import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Generator, Optional, Set, Tuple
from unittest import mock

import torch
from fairscale.internal.parallel import get_process_group_cached
from fairscale.nn.data_parallel import FullyShardedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.scenario import end_process_groups, global_rank, main, quiet_trainer_kwargs
from fsdp_harness.tensor_compare import compare_tensors
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.strategies import fsdp_streaming_save
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile
from tests.strategies.fsdp_collective_fault_scenarios import _outcome, sha256

UNITS = 3
#: which FSDP unit with parameters fails (1-based, in the order FairScale gathers them)
POSITIONS = {"first": 1, "middle": 2, "last": UNITS}
CASES = [(rank, position) for rank in (0, 1) for position in POSITIONS]
#: ``slow_write``: the timeout of the FSDP process groups, and the sleep of global rank 0's write, well past it (the
#: other rank, on its way to the next gather when the sleep begins, would wait there for most of it)
FSDP_GROUP_SECONDS = 3.0
SLOW_WRITE_SECONDS = 5.0


def _oom(where: str) -> MemoryError:
    return MemoryError(f"CUDA out of memory. Tried to allocate 64.00 MiB (injected: {where})")


class FailingRebuild:
    """While armed, FairScale's ``_rebuild_full_params`` raises ``MemoryError`` on global rank ``rank`` at its
    ``fail_on``-th call for an FSDP instance with parameters (the outer instance of nested ``wrap`` has none)."""

    def __init__(self) -> None:
        self.rank: Optional[int] = None
        self.fail_on, self.calls, self.raised = 0, 0, 0
        original = FullyShardedDataParallel._rebuild_full_params

        def rebuild(instance: FullyShardedDataParallel, *args: Any, **kwargs: Any) -> Any:
            if self.rank == global_rank() and instance.params:
                self.calls += 1
                if self.calls == self.fail_on:
                    self.raised += 1
                    raise _oom(f"_rebuild_full_params of unit {self.calls}")
            return original(instance, *args, **kwargs)

        FullyShardedDataParallel._rebuild_full_params = rebuild

    @contextlib.contextmanager
    def armed(self, rank: int, fail_on: int) -> Generator[None, None, None]:
        self.rank, self.fail_on, self.calls = rank, fail_on, 0
        try:
            yield
        finally:
            self.rank = None


class FailingUnitCopy(TorchDispatchMode):
    """While armed (entered) on global rank ``rank``: torch's first ``copy_`` into the parameters of the ``fail_on``-th
    FSDP unit with parameters of ``module`` (in module order) raises ``MemoryError`` from inside torch's dispatch. The
    destination is told by its storage: the unit's shard (``_fp32_shard``) or whatever its flat parameter's data is at
    that moment (the full parameters while ``summon_full_params`` gathers them)."""

    def __init__(self, module: torch.nn.Module, rank: int, fail_on: int) -> None:
        super().__init__()
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel) and m.params]
        self.unit, self.rank, self.raised = units[fail_on - 1], rank, 0
        self.fail_on = fail_on

    def _destinations(self) -> Set[int]:
        tensors = [t for p in self.unit.params for t in (p.data, getattr(p, "_fp32_shard", p.data))]
        return {t.untyped_storage().data_ptr() for t in tensors} - {0}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (
            func is torch.ops.aten.copy_.default
            and self.rank == global_rank()
            and not self.raised
            and args[0].untyped_storage().data_ptr() in self._destinations()
        ):
            self.raised += 1
            raise _oom(f"copy into unit {self.fail_on}")
        return func(*args, **(kwargs or {}))


class OutOfMemoryFrom:
    """While armed on global rank ``rank``: the ``fail_on``-th floating-point allocation by ``trigger``
    (``"empty_like"`` or ``"to"``) raises ``MemoryError``; with ``persistent``, so does every floating-point
    allocation after it: the device has no room for a state tensor any more, though small integer tensors (the
    failure flags, the pickled objects of ``broadcast_object_list``) still fit, as after a real CUDA OOM."""

    ALLOCATIONS = {
        "zeros": torch,
        "zeros_like": torch,
        "empty": torch,
        "empty_like": torch,
        "to": torch.Tensor,
        "new_zeros": torch.Tensor,
    }

    def __init__(self) -> None:
        self.originals = {name: getattr(owner, name) for name, owner in self.ALLOCATIONS.items()}
        self.rank: Optional[int] = None
        self.trigger, self.fail_on, self.persistent = "", 0, False
        self.calls, self.raised, self.after = 0, 0, 0
        for name, owner in self.ALLOCATIONS.items():
            setattr(owner, name, self._wrap(name, self.originals[name]))

    @staticmethod
    def _floating(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        dtype = kwargs.get("dtype")
        if name in ("zeros", "empty"):
            return dtype is None or dtype.is_floating_point
        if name == "to":  # ``Tensor.to(self, ...)``: a float tensor, unless converted to another dtype
            dtype = dtype or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
        return (dtype or args[0].dtype).is_floating_point

    def _wrap(self, name: str, original: Callable) -> Callable:
        def allocation(*args: Any, **kwargs: Any) -> Any:
            if self.rank == global_rank() and self._floating(name, args, kwargs):
                if self.raised and self.persistent:
                    self.after += 1
                    raise _oom(f"{name} after an earlier out-of-memory error")
                if name == self.trigger:
                    self.calls += 1
                    if self.calls == self.fail_on:
                        self.raised += 1
                        raise _oom(f"{name}, call {self.calls}")
            return original(*args, **kwargs)

        return allocation

    @contextlib.contextmanager
    def armed(self, rank: int, trigger: str, fail_on: int, persistent: bool) -> Generator[None, None, None]:
        self.rank, self.trigger, self.fail_on, self.persistent = rank, trigger, fail_on, persistent
        self.calls, self.raised, self.after = 0, 0, 0
        try:
            yield
        finally:
            self.rank = None


def _trainer(args: argparse.Namespace, strategy: CPUFullyShardedStrategy, **kwargs: Any) -> Trainer:
    # no validation: a sanity check before the first training step leaves FairScale 0.4.13 without the CPU gradient
    # buffers of ``cpu_offload`` (``_cpu_grad``, allocated only by a lazy init in training)
    kwargs = {"max_epochs": 1, "limit_val_batches": 0, "num_sanity_val_steps": 0, **kwargs}
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, strategy=strategy, **kwargs))


def _model(**kwargs: Any) -> FSDPModel:
    seed_everything(1)
    return FSDPModel(**{"width": 8, "units": UNITS, "batches": 1, **kwargs})


def _fitted(args: argparse.Namespace, model: FSDPModel, **strategy_kwargs: Any) -> Tuple[Trainer, Path]:
    # the faults are in the gathers and rank 0's writes of a save that global rank 0 writes alone; every rank writing
    # its own shards (the default ``"auto"`` on one host) gathers no unit
    trainer = _trainer(args, CPUFullyShardedStrategy(**{"checkpoint_writers": "rank0", **strategy_kwargs}))
    trainer.fit(model)
    path = args.out / "ckpts" / "model.ckpt"
    path.parent.mkdir(exist_ok=True)
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    return trainer, path


def _failed_save(trainer: Trainer, path: Path, fault: Callable[[], Any]) -> Dict[str, Any]:
    """Save over ``path`` with ``fault()`` armed, then save again elsewhere, unarmed: the outcome of the first, and
    on rank 0 the previous file's hash, the folder's files, and whether the second file equals the previous one."""
    trainer.strategy.barrier()
    start = time.monotonic()
    outcome: Dict[str, Any] = {"raised": False}
    try:
        with fault():
            trainer.save_checkpoint(path)
    except Exception as error:
        outcome = _outcome(start, error)
    files = sorted(p.name for p in path.parent.iterdir())
    retry = path.with_name("retry.ckpt")
    trainer.save_checkpoint(retry)
    if trainer.is_global_zero:
        load = [torch.load(p, map_location="cpu", weights_only=False) for p in (path, retry)]
        same = compare_tensors(*({k: c[k] for k in ("state_dict", "optimizer_states")} for c in load))
        outcome.update(after=sha256(path), files=files, retry_equal=same["ok"], retry_compared=same["compared"])
        retry.unlink()
    trainer.strategy.barrier()
    return outcome


def _trains(model: FSDPModel) -> bool:
    """Collective: a forward and backward pass through the FSDP units still works after the failures."""
    model.zero_grad()
    model(torch.randn(2, model.width)).sum().backward()
    return all(p.grad is not None for p in model.parameters() if p.requires_grad)


def save_cases(args: argparse.Namespace) -> Dict[str, Any]:
    fault = FailingRebuild()
    model = _model()
    trainer, path = _fitted(args, model, stream_checkpoint=args.scenario == "streamed")
    before = sha256(path) if trainer.is_global_zero else None
    cases = []
    for rank, position in CASES:
        outcome = _failed_save(trainer, path, lambda: fault.armed(rank, POSITIONS[position]))
        cases.append({"fail_rank": rank, "position": position, "injected": fault.raised, **outcome})
        fault.raised = 0
    return {"rank": trainer.global_rank, "before": before, "cases": cases, "trains": _trains(model)}


def load_cases(args: argparse.Namespace) -> Dict[str, Any]:
    trainer, path = _fitted(args, _model())
    expected = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    before = sha256(path) if trainer.is_global_zero else None
    cases = []
    for rank, position in CASES:
        strategy = CPUFullyShardedStrategy()
        original_load, start, faults = strategy.load_model_state_dict, [0.0], []

        def load_model_state_dict(checkpoint: Any, rank: int = rank, position: str = position) -> None:
            start[0] = time.monotonic()
            faults.append(FailingUnitCopy(strategy.lightning_module, rank, POSITIONS[position]))
            with faults[-1]:
                original_load(checkpoint)

        strategy.load_model_state_dict = load_model_state_dict
        outcome: Dict[str, Any] = {"raised": False}
        try:
            # max_epochs=2: the checkpoint was saved at the end of the first epoch, so this fit trains after it
            _trainer(args, strategy, max_epochs=2).fit(_model(), ckpt_path=str(path))
        except Exception as error:
            outcome = _outcome(start[0], error)
        # the retry, in the same processes: restores the checkpoint's weights exactly
        model = _model()
        retry = _trainer(args, CPUFullyShardedStrategy())
        retry.fit(model, ckpt_path=str(path))
        restored = full_parameters(model)
        outcome["retry_equal"] = all(k in restored and torch.equal(expected[k], restored[k]) for k in expected)
        if trainer.is_global_zero:
            outcome.update(after=sha256(path), files=sorted(p.name for p in path.parent.iterdir()))
        injected = sum(fault.raised for fault in faults)
        cases.append({"fail_rank": rank, "position": position, "injected": injected, **outcome})
    return {"rank": trainer.global_rank, "before": before, "cases": cases, "trains": _trains(model)}


def allocation_cases(args: argparse.Namespace) -> Dict[str, Any]:
    oom = OutOfMemoryFrom()
    cases = []
    # (layout, save path, failing rank, trigger, which call, persistent)
    plan = [
        ("plain", "gathered", 0, "empty_like", 2, False),
        ("plain", "streamed", 0, "empty_like", 2, False),
        ("plain", "gathered", 1, "to", 2, True),
        ("plain", "streamed", 1, "to", 2, True),
        ("plain", "gathered", 0, "to", 1, True),
        ("offload", "gathered", 1, "to", 2, True),
        ("offload", "streamed", 0, "to", 2, True),
    ]
    trainers: Dict[str, Tuple[Trainer, Path, FSDPModel]] = {}
    for layout, save, rank, trigger, fail_on, persistent in plan:
        if layout not in trainers:
            if layout == "offload":
                # one FSDP instance per block: FairScale 0.4.13 cannot gather an instance without parameters of its
                # own with ``cpu_offload`` (see ``fsdp_resume_scenarios.LAYOUTS``)
                model = _model(wrapping="auto_wrap")
                trainer, path = _fitted(args, model, cpu_offload=True, min_num_params=50)
            else:
                model = _model()
                trainer, path = _fitted(args, model)
            trainers[layout] = (trainer, path, model)
        trainer, path, model = trainers[layout]
        strategy = trainer.strategy
        before = sha256(path) if trainer.is_global_zero else None
        strategy.stream_checkpoint = save == "streamed"
        # armed while the optimizer state is gathered only: the model's gather allocates with the same functions
        # (the streamed save's optimizer state is gathered by its part's function, the strategy's by its method)
        owner: Any = fsdp_streaming_save if save == "streamed" else strategy
        method = "_stream_optimizer_state" if save == "streamed" else "optimizer_state"
        original = getattr(owner, method)

        @contextlib.contextmanager
        def fault(rank: int = rank, trigger: str = trigger, fail_on: int = fail_on, persistent: bool = persistent):
            def armed_method(*a: Any, **k: Any) -> Any:
                with oom.armed(rank, trigger, fail_on, persistent):
                    return original(*a, **k)

            with mock.patch.object(owner, method, armed_method):
                yield

        outcome = _failed_save(trainer, path, fault)
        outcome.update(before=before, allocations_after_oom=oom.after)
        cases.append(
            {"layout": layout, "save": save, "fail_rank": rank, "trigger": trigger, "injected": oom.raised, **outcome}
        )
    return {"rank": global_rank(), "cases": cases, "trains": _trains(trainers["plain"][2])}


def slow_write(args: argparse.Namespace) -> Dict[str, Any]:
    original_new_group = torch.distributed.new_group

    def new_group(*a: Any, **k: Any) -> Any:
        # a group that sets no timeout of its own, such as the FSDP process group, gets its backend's default
        # (NCCL's: ten minutes); here FSDP_GROUP_SECONDS. The checkpoint group sets ``PL_CHECKPOINT_TIMEOUT``.
        k.setdefault("timeout", timedelta(seconds=FSDP_GROUP_SECONDS))
        return original_new_group(*a, **k)

    torch.distributed.new_group = new_group
    # FairScale's process-wide groups too (its reduce-scatter group), not those of the batch's earlier scenarios
    with mock.patch.object(get_process_group_cached, "_global_group_cache", {}, create=True):
        return _slow_write(args)


def _slow_write(args: argparse.Namespace) -> Dict[str, Any]:
    model = _model(width=64)  # units of 16 KiB: one ``pwrite`` per parameter
    trainer, path = _fitted(args, model)
    original_pwrite, original_skeleton = os.pwrite, _StreamedCheckpointFile.write_skeleton
    unit_writes, slept = [-1], [0.0]

    def write_skeleton(self: _StreamedCheckpointFile, *a: Any, **k: Any) -> None:
        original_skeleton(self, *a, **k)
        unit_writes[0] = 0  # from here on, the values of the gathered units

    def slow_pwrite(fd: int, data: Any, offset: int) -> int:
        if unit_writes[0] >= 0:
            unit_writes[0] += 1
            if unit_writes[0] == 2:  # the first unit's bias: the other rank is on its way to the second unit
                time.sleep(SLOW_WRITE_SECONDS)
                slept[0] = SLOW_WRITE_SECONDS
        return original_pwrite(fd, data, offset)

    trainer.strategy.barrier()
    if trainer.is_global_zero:
        os.pwrite, _StreamedCheckpointFile.write_skeleton = slow_pwrite, write_skeleton
    start = time.monotonic()
    outcome: Dict[str, Any] = {"raised": False}
    try:
        trainer.save_checkpoint(path)
    except Exception as error:
        outcome = _outcome(start, error)
    finally:
        os.pwrite, _StreamedCheckpointFile.write_skeleton = original_pwrite, original_skeleton
    outcome["seconds"] = time.monotonic() - start
    full = full_parameters(model)
    if trainer.is_global_zero:
        saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        outcome.update(slept=slept[0], equal=all(torch.equal(saved[k], full[k]) for k in full))
        outcome["group_seconds"] = FSDP_GROUP_SECONDS
    return {"rank": trainer.global_rank, "cases": [outcome]}


class FailingState(Callback):
    """A callback whose ``state_dict`` raises on global rank ``rank`` while armed: a failure outside the per-unit
    loops, between the model's gather and the optimizer state's (``dump_checkpoint`` asks the callbacks in between)."""

    def __init__(self) -> None:
        self.rank: Optional[int] = None
        self.raised = 0

    def state_dict(self) -> Dict[str, Any]:
        if self.rank == global_rank():
            self.raised += 1
            raise _oom("a callback's state_dict")
        return {}

    @contextlib.contextmanager
    def armed(self, rank: int) -> Generator[None, None, None]:
        self.rank = rank
        try:
            yield
        finally:
            self.rank = None


def outside_loop(args: argparse.Namespace) -> Dict[str, Any]:
    callback = FailingState()
    model = _model()
    trainer = _trainer(args, CPUFullyShardedStrategy(stream_checkpoint=False), callbacks=[callback])
    trainer.fit(model)
    path = args.out / "ckpts" / "model.ckpt"
    path.parent.mkdir(exist_ok=True)
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    before = sha256(path) if trainer.is_global_zero else None
    cases = []
    for rank in (0, 1):
        outcome = _failed_save(trainer, path, lambda: callback.armed(rank))
        cases.append({"fail_rank": rank, "position": "outside", "injected": callback.raised, **outcome})
        callback.raised = 0
    return {"rank": trainer.global_rank, "before": before, "cases": cases, "trains": _trains(model)}


def _patched_attributes() -> contextlib.ExitStack:
    """What the scenarios replace for their faults: restored after each, so that the next scenario of a batch
    (``fsdp_harness.runner.ScenarioBatch``) starts from the real ones."""
    stack = contextlib.ExitStack()
    owners = [(FullyShardedDataParallel, "_rebuild_full_params"), (torch.distributed, "new_group"), (os, "pwrite"),
              (_StreamedCheckpointFile, "write_skeleton")]
    for owner, name in owners + [(owner, name) for name, owner in OutOfMemoryFrom.ALLOCATIONS.items()]:
        stack.enter_context(mock.patch.object(owner, name, getattr(owner, name)))
    return stack


def _teardown(run: Callable[[argparse.Namespace], Dict[str, Any]]) -> Callable[[argparse.Namespace], Dict[str, Any]]:
    def scenario(args: argparse.Namespace) -> Dict[str, Any]:
        with _patched_attributes():
            result = run(args)
        # tear the process groups down while every rank is here (see ``fsdp_collective_fault_scenarios``)
        end_process_groups()
        return result

    return scenario


if __name__ == "__main__":
    main(
        {
            "streamed": _teardown(save_cases),
            "gathered": _teardown(save_cases),
            "load": _teardown(load_cases),
            "allocations": _teardown(allocation_cases),
            "slow_write": _teardown(slow_write),
            "outside_loop": _teardown(outside_loop),
        }
    )
