"""Checkpoints written in the background (``DDPFullyShardedStrategy(async_checkpoint=True)``) on CPU FSDP (2 ranks over
gloo): ``python -m tests.strategies.fsdp_async_scenarios <scenario> --out DIR``.

- ``failures``: in one run, a save whose background write fails on global rank 0 with ``ENOSPC`` (``os.pwrite`` in
  the writer thread), found by the next save; one found by ``wait_for_checkpoint``; one whose gather fails on rank 1
  in its writer thread, before it sends its shard (rank 0 then waits in the gather until ``PL_CHECKPOINT_TIMEOUT``).
  After each, a save succeeds.
- ``kill``: global rank 0 kills every rank (``SIGKILL``) while its writer thread is writing a checkpoint over an
  earlier one; ``cleanup`` then lists the temporary files the killed writer left in that folder (``--folder``) and
  saves into it.
- ``model_checkpoint``: ``ModelCheckpoint(save_top_k=1, save_last=True)`` every epoch while rank 0's writes are
  slowed; a thread on rank 0 lists the folder every few milliseconds. ``--broken-ordering`` removes replaced files
  at once, as ``ModelCheckpoint`` asks, instead of after their successor is committed.
- ``lifecycle``: in one run, with rank 0's writes slowed so that every save is still in flight at the next one:
  ``ModelCheckpoint(filename="fixed", save_top_k=-1, every_n_train_steps=1)`` synchronously and in the background,
  with a logger that records what its ``after_save_checkpoint`` finds on disk; a save whose writer thread cannot start
  on rank 1 (``Thread.start`` raises, as under a pids cgroup limit); and ``SIGINT`` on every rank while a save is in
  flight, in a training step and while the rank waits for the save, after which ``fit`` returns.
- ``host_memory``: every rank reads its host memory from a fake ``/proc`` and cgroup filesystem (``--proc``, made by
  the test with ``tests/helpers/fake_proc.py``: both ranks in one Slurm-like job cgroup). At the end of the first
  epoch, global rank 0 sets the job's headroom (``--headrooms``, bytes) before each save, made with the
  ``checkpoint_writers`` of ``--writers`` (``rank0`` where not given); every rank reports whether each went to the
  background and the warnings it logged, and rank 0 compares the files.
- ``fit``: ``fsdp_resume_scenarios``'s, so that its exact-resume runs share the launches of these scenarios.

``--checkpoint-timeout`` sets ``PL_CHECKPOINT_TIMEOUT`` for one scenario (without it, the variable is unset). The
scenarios run one after the other in the same processes (``fsdp_harness.runner.ScenarioBatch``): what a scenario
replaces for its faults and slowed writes, and that variable, are restored after it, so that the next one starts from
the real ones. Every rank writes ``<out>/rank<N>.json``; driven by ``test_ddp_fully_sharded_async.py``.
"""
import argparse
import contextlib
import errno
import functools
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional
from unittest import mock

import torch

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from fsdp_harness.tensor_compare import compare_tensors, iter_tensors
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import LightningLoggerBase
from pytorch_lightning.strategies import fsdp_async_checkpoint
from pytorch_lightning.strategies.ddp import DDPStrategy
from pytorch_lightning.strategies.fsdp_checkpointing_strategy import _FSDPCheckpointingStrategy
from pytorch_lightning.utilities import host_memory
from pytorch_lightning.utilities.checkpoint_errors import CHECKPOINT_TIMEOUT_ENV
from tests.helpers.fake_proc import FakeProc
from tests.strategies import fsdp_resume_scenarios
from tests.strategies.fsdp_collective_fault_scenarios import _outcome, sha256

WRITER_THREAD = "pl-async-checkpoint"


class InWriterThread:
    """Replaces ``owner.name`` with a wrapper that calls ``fault(*args)`` first when it runs in the writer thread of
    global rank ``rank`` and the fault is armed."""

    def __init__(self, owner: Any, name: str, rank: int, fault: Callable[..., None]) -> None:
        self.armed = False
        original = getattr(owner, name)

        # keeps ``original``'s signature: the strategy checks at setup that the collectives take a ``group``
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.armed and global_rank() == rank and threading.current_thread().name == WRITER_THREAD:
                fault(*args)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)


def _no_space(*args: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _strategy(async_checkpoint: bool = True) -> CPUFullyShardedStrategy:
    """These scenarios are about the background save that global rank 0 writes alone (its writer thread's faults,
    its slowed writes), so they pin ``checkpoint_writers="rank0"``: the default ``"auto"`` lets every rank write
    its own copies on one host (``test_ddp_fully_sharded_parallel_save.py`` tests that)."""
    return CPUFullyShardedStrategy(async_checkpoint=async_checkpoint, checkpoint_writers="rank0")


def _trainer(args: argparse.Namespace, **kwargs: Any) -> Trainer:
    defaults = dict(
        strategy=_strategy(),
        max_epochs=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **kwargs}))


def _model() -> FSDPModel:
    seed_everything(1)
    return FSDPModel(width=16, units=3, batches=2, extra_before=True)


def _tmp_files(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


class FailingSaves(Callback):
    """At the end of the first epoch: a good save, then the failing ones, each followed by a save that succeeds."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.folder = args.out / "ckpts"
        self.enospc = InWriterThread(os, "pwrite", 0, _no_space)
        self.gather = InWriterThread(torch.distributed, "gather", 1, self._broken_send)
        self.result: Dict[str, Any] = {"cases": []}

    def _broken_send(self, *args: Any) -> None:
        raise RuntimeError("injected: the shard could not be sent")

    def _save(self, trainer: Trainer, name: str) -> Dict[str, Any]:
        start = time.monotonic()
        trainer.save_checkpoint(self.folder / name)
        stall = time.monotonic() - start
        return {"stall": stall, "in_flight": trainer.strategy._checkpoint_state.in_flight is not None}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.current_epoch != 0:
            return
        strategy = trainer.strategy
        path = self.folder / "model.ckpt"
        self.result["good"] = self._save(trainer, "model.ckpt")
        strategy.wait_for_checkpoint()
        before = sha256(path) if trainer.is_global_zero else None
        for case, fault, found_by in (
            ("enospc", self.enospc, "next save"),
            ("enospc", self.enospc, "wait_for_checkpoint"),
            ("rank 1 send", self.gather, "next save"),
        ):
            fault.armed = True
            outcome: Dict[str, Any] = {"case": case, "found_by": found_by, **self._save(trainer, "model.ckpt")}
            start = time.monotonic()
            try:
                if found_by == "next save":
                    trainer.save_checkpoint(self.folder / "other.ckpt")
                else:
                    strategy.wait_for_checkpoint()
                outcome["raised"] = False
            except Exception as error:
                outcome.update(_outcome(start, error))
            fault.armed = False
            strategy.barrier()
            if trainer.is_global_zero:
                outcome.update(after=sha256(path), tmp=_tmp_files(self.folder), files=sorted(os.listdir(self.folder)))
            # and then a save goes through
            self._save(trainer, "retry.ckpt")
            strategy.wait_for_checkpoint()
            outcome["retry_ok"] = (self.folder / "retry.ckpt").exists()
            self.result["cases"].append(outcome)
        self.result["before"] = before


def failures(args: argparse.Namespace) -> Dict[str, Any]:
    (args.out / "ckpts").mkdir(parents=True, exist_ok=True)
    saves = FailingSaves(args)
    trainer = _trainer(args, callbacks=[saves])
    trainer.fit(_model())
    return {"rank": trainer.global_rank, **saves.result}


def kill(args: argparse.Namespace) -> Dict[str, Any]:
    folder = args.out / "ckpts"
    folder.mkdir(parents=True, exist_ok=True)

    class KillWhileWriting(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
            path = folder / "model.ckpt"
            trainer.save_checkpoint(path)
            trainer.strategy.wait_for_checkpoint()
            if trainer.is_global_zero:
                (args.out / "before.sha256").write_text(sha256(path))
            InWriterThread(os, "pwrite", 0, lambda *a: time.sleep(0.5)).armed = True
            trainer.save_checkpoint(path)
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                deadline = time.monotonic() + 30
                while not _tmp_files(folder) and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(1.0)  # the writer thread is in the middle of the units
                (args.out / "tmp_before_kill.txt").write_text("\n".join(_tmp_files(folder)))
                os.killpg(os.getpgrp(), signal.SIGKILL)
            time.sleep(60)

    trainer = _trainer(args, max_epochs=1, callbacks=[KillWhileWriting()])
    trainer.fit(_model())
    return {"rank": trainer.global_rank, "killed": False}


def cleanup(args: argparse.Namespace) -> Dict[str, Any]:
    folder = Path(args.folder)
    # what the killed writer left, before anything here saves: the test checks that there is something to remove
    debris = _tmp_files(folder)

    class SaveAgain(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
            trainer.save_checkpoint(folder / "next.ckpt")

    trainer = _trainer(args, max_epochs=1, callbacks=[SaveAgain()])
    model = _model()
    trainer.fit(model)
    full = full_parameters(model)
    result: Dict[str, Any] = {"rank": trainer.global_rank}
    if trainer.is_global_zero:
        saved = torch.load(folder / "next.ckpt", map_location="cpu", weights_only=False)["state_dict"]
        result.update(
            debris=debris,
            tmp=_tmp_files(folder),
            before=sha256(folder / "model.ckpt"),
            loads=torch.load(folder / "model.ckpt", map_location="cpu", weights_only=False)["epoch"] == 0,
            equal=all(torch.equal(saved[k], full[k]) for k in full),
        )
    return result


class FolderMonitor(threading.Thread):
    """Lists ``folder`` every few milliseconds until stopped: the fewest complete checkpoints (``*.ckpt``: a file
    gets its name only once it is committed) and the fewest ``save_top_k`` ones (not ``last.ckpt``) seen after the
    first of each appeared."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.stop = folder, threading.Event()
        self.fewest: Dict[str, Any] = {"all": None, "top_k": None}
        self.listings = 0

    def run(self) -> None:
        while not self.stop.is_set():
            names = [n for n in os.listdir(self.folder) if n.endswith(".ckpt")]
            for kind, count in (("all", len(names)), ("top_k", len([n for n in names if n != "last.ckpt"]))):
                seen = self.fewest[kind]
                if count or seen is not None:
                    self.fewest[kind] = count if seen is None else min(seen, count)
            self.listings += 1
            time.sleep(0.002)


def model_checkpoint(args: argparse.Namespace) -> Dict[str, Any]:
    folder = args.out / "ckpts"
    folder.mkdir(parents=True, exist_ok=True)
    if args.broken_ordering:
        _FSDPCheckpointingStrategy.remove_checkpoint = DDPStrategy.remove_checkpoint
    slow = InWriterThread(os, "pwrite", 0, lambda *a: time.sleep(0.05))
    slow.armed = True
    monitor = FolderMonitor(folder)
    if global_rank() == 0:
        monitor.start()
    checkpoint = ModelCheckpoint(dirpath=str(folder), filename="{epoch}", save_top_k=1, save_last=True)
    trainer = _trainer(args, max_epochs=4, callbacks=[checkpoint], enable_checkpointing=True)
    stalls: List[float] = []
    original_save = trainer.save_checkpoint

    def timed_save(*a: Any, **k: Any) -> None:
        start = time.monotonic()
        original_save(*a, **k)
        stalls.append(time.monotonic() - start)

    trainer.save_checkpoint = timed_save
    trainer.fit(_model())
    monitor.stop.set()
    result: Dict[str, Any] = {"rank": trainer.global_rank, "stalls": stalls}
    if trainer.is_global_zero:
        monitor.join()
        result.update(
            fewest=monitor.fewest,
            listings=monitor.listings,
            files=sorted(os.listdir(folder)),
            best=Path(checkpoint.best_model_path).name,
            last=Path(checkpoint.last_model_path).name,
            best_epoch=torch.load(checkpoint.best_model_path, map_location="cpu", weights_only=False)["epoch"],
            last_epoch=torch.load(checkpoint.last_model_path, map_location="cpu", weights_only=False)["epoch"],
        )
    return result


class CheckpointFilesLogger(LightningLoggerBase):
    """Records, for each ``after_save_checkpoint``, the ``best_model_path`` it is told about and what that file
    holds at that moment: a loggers that uploads it (Neptune, W&B) uploads that."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Dict[str, Any]] = []

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        path = Path(checkpoint_callback.best_model_path)
        entry: Dict[str, Any] = {"name": path.name, "exists": path.exists(), "step": None}
        if path.exists():
            entry["step"] = torch.load(path, map_location="cpu", weights_only=False)["global_step"]
        self.seen.append(entry)

    @property
    def experiment(self) -> Any:
        return None

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def name(self) -> str:
        return "files"

    @property
    def version(self) -> int:
        return 0


def _saved_steps(folder: Path) -> Dict[str, int]:
    return {
        p.name: torch.load(p, map_location="cpu", weights_only=False)["global_step"]
        for p in sorted(folder.glob("*.ckpt"))
    }


def _open_temporary_files() -> List[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(n for n in names if n.endswith(".tmp"))


def _writer_threads() -> int:
    # by name: ``is_alive`` is False for a running thread whose ``join`` a ``KeyboardInterrupt`` broke off
    return sum(t.name == WRITER_THREAD for t in threading.enumerate())


def _fixed_name_saves(args: argparse.Namespace, async_checkpoint: bool) -> Dict[str, Any]:
    """``save_top_k=-1`` with a name that does not change between saves, one save per step."""
    folder = args.out / ("async" if async_checkpoint else "sync")
    checkpoint = ModelCheckpoint(dirpath=str(folder), filename="fixed", save_top_k=-1, every_n_train_steps=1)
    logger = CheckpointFilesLogger()
    trainer = _trainer(
        args,
        strategy=_strategy(async_checkpoint),
        max_epochs=1,
        callbacks=[checkpoint],
        enable_checkpointing=True,
        logger=logger,
    )
    model = _model()
    model.batches = 4
    trainer.fit(model)
    result: Dict[str, Any] = {"async_group_left": trainer.strategy._checkpoint_state.background_group is not None}
    if trainer.is_global_zero:
        result.update(files=_saved_steps(folder), logged=logger.seen, tmp=_tmp_files(folder))
    return result


class StartFails(Callback):
    """At the end of the first epoch: a good save, then one whose writer thread cannot start on global rank 1, then
    one more."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.result: Dict[str, Any] = {}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        path = self.folder / "model.ckpt"
        trainer.save_checkpoint(path)
        trainer.strategy.wait_for_checkpoint()
        before = sha256(path) if trainer.is_global_zero else None
        original_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            if thread.name == WRITER_THREAD and global_rank() == 1:
                raise RuntimeError("can't start new thread")
            original_start(thread)

        threading.Thread.start = start
        start_time = time.monotonic()
        try:
            trainer.save_checkpoint(path)
            self.result["raised"] = False
        except Exception as error:
            self.result.update(_outcome(start_time, error))
        finally:
            threading.Thread.start = original_start
        self.result.update(
            in_flight=trainer.strategy._checkpoint_state.in_flight is not None,
            writer_threads=_writer_threads(),
            open_tmp=_open_temporary_files(),
        )
        if trainer.is_global_zero:
            self.result.update(unchanged=sha256(path) == before, tmp=_tmp_files(self.folder))
        trainer.save_checkpoint(self.folder / "retry.ckpt")
        trainer.strategy.wait_for_checkpoint()
        self.result["retry_ok"] = (self.folder / "retry.ckpt").exists()


class InterruptWhileSaving(Callback):
    """At the start of the third step, while the save of the second is in flight: ``SIGINT`` to this rank, as a
    terminal's Ctrl-C sends it to every process of the job; with ``during_wait``, while this rank waits for that save
    in ``wait_for_checkpoint`` (where training waits when saves are slow)."""

    def __init__(self, during_wait: bool) -> None:
        self.during_wait = during_wait

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        self.in_flight = trainer.strategy._checkpoint_state.in_flight is not None
        self.in_wait = False
        if self.during_wait:
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                trainer.strategy.wait_for_checkpoint()
            except KeyboardInterrupt:
                self.in_wait = True
                raise
        else:
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt is raised by now


def _interrupted_fit(args: argparse.Namespace, during_wait: bool) -> Dict[str, Any]:
    folder = args.out / ("interrupted-waiting" if during_wait else "interrupted")
    checkpoint = ModelCheckpoint(dirpath=str(folder), filename="{step}", save_top_k=1, every_n_train_steps=1)
    interrupt = InterruptWhileSaving(during_wait)
    trainer = _trainer(args, max_epochs=1, callbacks=[interrupt, checkpoint], enable_checkpointing=True)
    model = _model()
    model.batches = 4
    # as in a job started from a terminal, where Ctrl-C raises ``KeyboardInterrupt``: a process started in the
    # background by a shell without job control (``pytest ... &`` in a script) inherits SIGINT ignored, and then the
    # signal interrupts nothing and ``fit`` finishes
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trainer.fit(model)
    finally:
        signal.signal(signal.SIGINT, previous)
    result: Dict[str, Any] = {
        "status": str(trainer.state.status),
        "was_in_flight": interrupt.in_flight,
        "in_wait": interrupt.in_wait,
        "in_flight": trainer.strategy._checkpoint_state.in_flight is not None,
        "writer_threads": _writer_threads(),
        "async_group_left": trainer.strategy._checkpoint_state.background_group is not None,
    }
    if trainer.is_global_zero:
        result.update(files=_saved_steps(folder), tmp=_tmp_files(folder))
    return result


def lifecycle(args: argparse.Namespace) -> Dict[str, Any]:
    slow = InWriterThread(os, "pwrite", 0, lambda *a: time.sleep(0.02))
    slow.armed = True
    result: Dict[str, Any] = {"rank": global_rank()}
    result["sync"] = _fixed_name_saves(args, async_checkpoint=False)
    result["async"] = _fixed_name_saves(args, async_checkpoint=True)
    folder = args.out / "start"
    folder.mkdir(parents=True, exist_ok=True)
    start_fails = StartFails(folder)
    _trainer(args, max_epochs=1, callbacks=[start_fails]).fit(_model())
    result["start_fails"] = start_fails.result
    result["interrupted"] = _interrupted_fit(args, during_wait=False)
    result["interrupted_waiting"] = _interrupted_fit(args, during_wait=True)
    return result


#: the ``FSDPModel`` of ``host_memory``: its full parameters take ``S = 4 * UNITS * (WIDTH * WIDTH + WIDTH)`` bytes
HOST_MEMORY_WIDTH, HOST_MEMORY_UNITS = 64, 2
GIB = 2**30


def host_memory_scenario(args: argparse.Namespace) -> Dict[str, Any]:
    host_memory.PROC_ROOT = str(Path(args.proc) / "proc")
    fake = FakeProc(Path(args.proc), create=False)
    folder = args.out / "ckpts"
    folder.mkdir(parents=True, exist_ok=True)
    result: Dict[str, Any] = {"saves": []}

    class SavesWithHeadroom(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
            if trainer.current_epoch != 0:
                return
            strategy = trainer.strategy
            for index, headroom in enumerate(args.headrooms):
                strategy.checkpoint_writers = (args.writers[index:] or ["rank0"])[0]
                strategy.barrier()
                if trainer.is_global_zero:
                    fake.set_job_memory(limit=GIB + headroom, usage=GIB)
                strategy.barrier()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    trainer.save_checkpoint(folder / f"save{index}.ckpt")
                background = strategy._checkpoint_state.in_flight is not None
                strategy.wait_for_checkpoint()
                logged = [str(w.message) for w in caught if "async_checkpoint=True" in str(w.message)]
                result["saves"].append({"background": background, "warnings": logged})
            result["parameters"] = {k: v.clone() for k, v in full_parameters(pl_module).items()}

    seed_everything(1)
    model = FSDPModel(width=HOST_MEMORY_WIDTH, units=HOST_MEMORY_UNITS, batches=2, optimizer="adam")
    trainer = _trainer(args, max_epochs=1, callbacks=[SavesWithHeadroom()])
    trainer.fit(model)
    parameters = result.pop("parameters")
    result["rank"] = trainer.global_rank
    if trainer.is_global_zero:
        saved = [torch.load(folder / f"save{i}.ckpt", weights_only=False) for i in range(len(args.headrooms))]
        result["complete"] = all(torch.equal(saved[0]["state_dict"][k], v) for k, v in parameters.items())
        result["optimizer_tensors"] = len(list(iter_tensors(saved[0]["optimizer_states"])))
        result["equal"] = [compare_tensors(saved[0], other)["ok"] for other in saved[1:]]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fsdp_resume_scenarios.add_arguments(parser)
    parser.add_argument("--broken-ordering", action="store_true")
    parser.add_argument("--proc", help="the fake /proc and cgroup filesystem (host_memory)")
    parser.add_argument("--headrooms", type=int, nargs="*", default=[], help="bytes left in the job (host_memory)")
    parser.add_argument("--writers", nargs="*", default=[], help="checkpoint_writers of each save (host_memory)")
    parser.add_argument("--folder", help="the checkpoint folder of the killed run (cleanup)")
    parser.add_argument("--checkpoint-timeout", help=f"`{CHECKPOINT_TIMEOUT_ENV}` for this scenario (default: unset)")


@contextlib.contextmanager
def _checkpoint_timeout(seconds: Optional[str]) -> Iterator[None]:
    """``PL_CHECKPOINT_TIMEOUT`` is ``seconds``, or unset (the default timeout), until the scenario ends, whatever an
    earlier scenario of the batch set: a rank >= 1 starts with rank 0's environment of that moment. Only this
    variable is restored; the environment also holds what Lightning's launcher exported for the next ``fit``."""
    previous = os.environ.pop(CHECKPOINT_TIMEOUT_ENV, None)
    if seconds is not None:
        os.environ[CHECKPOINT_TIMEOUT_ENV] = seconds
    try:
        yield
    finally:
        os.environ.pop(CHECKPOINT_TIMEOUT_ENV, None)
        if previous is not None:
            os.environ[CHECKPOINT_TIMEOUT_ENV] = previous


def _patched_attributes() -> contextlib.ExitStack:
    """What the scenarios replace for their faults, slowed writes and counts: restored after each, so that the next
    scenario of a batch starts from the real ones."""
    stack = contextlib.ExitStack()
    for owner, name in (
        (os, "pwrite"),
        (torch.distributed, "gather"),
        (threading.Thread, "start"),
        (_FSDPCheckpointingStrategy, "remove_checkpoint"),
        (host_memory, "PROC_ROOT"),
        (fsdp_async_checkpoint._BackgroundSave, "start"),
    ):
        stack.enter_context(mock.patch.object(owner, name, getattr(owner, name)))
    return stack


def _restoring(scenario: Callable[[argparse.Namespace], Dict[str, Any]]) -> Callable[..., Dict[str, Any]]:
    @functools.wraps(scenario)
    def run(args: argparse.Namespace) -> Dict[str, Any]:
        with _patched_attributes(), _checkpoint_timeout(args.checkpoint_timeout):
            return scenario(args)

    return run


if __name__ == "__main__":
    scenarios = {
        "failures": failures,
        "kill": kill,
        "cleanup": cleanup,
        "model_checkpoint": model_checkpoint,
        "lifecycle": lifecycle,
        "host_memory": host_memory_scenario,
        "fit": fsdp_resume_scenarios.fit,
    }
    main({name: _restoring(scenario) for name, scenario in scenarios.items()}, add_arguments)
