"""Slurm's ``SIGUSR1`` with ``SLURMEnvironment(auto_requeue=True)``, on 2 CPU tasks over gloo:
``python -m tests.trainer.connectors.slurm_requeue_scenarios cases --out DIR [--cases NAME ...]``, started once per
task as ``srun`` starts a job step (``tests/helpers/fake_slurm.py``), with a fake ``scontrol`` on ``PATH``.

Slurm signals every task of a job at the same moment (``--signal=USR1@<seconds>`` before the time limit). Here global
rank 0 does so from inside a backward pass, once every task is inside it too: from a gradient hook on the output of
the model's first block, which runs after the later blocks' backward (FairScale's post-backward hooks) and before the
first's; it signals the other task, then itself. A wrapper around Lightning's handler records where each task was
when the handler ran. Cases, one after the other in the same two processes, each in its own folder:

- ``fsdp-stream``: ``DDPFullyShardedStrategy`` (synchronous streamed save), signalled in the second batch; then a fit
  in the same folder, which resumes from the HPC checkpoint as a requeued job does, signalled in its first batch
  while global rank 0's writes fail (``ENOSPC``).
- ``fsdp-async``: ``async_checkpoint=True`` with rank 0's background writes slowed; then a resumed fit.
- ``ddp``: ``DDPStrategy``; then a resumed fit signalled in the middle of a validation run (once both tasks are in
  it).

Every task writes ``<out>/rank<N>.json``; driven by ``test_slurm_requeue.py``.
"""
import argparse
import errno
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.strategies import DDPFullyShardedStrategy, DDPStrategy, Strategy
from tests.strategies.fsdp_async_scenarios import InWriterThread
from tests.strategies.fsdp_collective_fault_scenarios import sha256

BATCHES = 4
#: the batch of the first fit of each case in whose backward pass the tasks are signalled
SIGNALLED_BATCH = 1
#: the resumed DDP fit validates after every second training batch
VAL_CHECK_INTERVAL = 2
CASES = ["fsdp-stream", "fsdp-async", "ddp"]


def _signal_every_task(out: Path) -> None:
    """``SIGUSR1`` to every task, as Slurm sends it: this task's last, so that its own handler, which Python runs at
    the next bytecode, runs only once the others are signalled too."""
    pids = [int(path.read_text()) for path in sorted((out / "pids").iterdir())]
    for pid in sorted(pids, key=lambda pid: pid == os.getpid()):
        os.kill(pid, signal.SIGUSR1)


def _first_block(module: torch.nn.Module) -> torch.nn.Module:
    """The first of the model's blocks: an inner FSDP instance, or with DDP the first ``nn.Sequential`` block."""
    from fairscale.nn import FullyShardedDataParallel

    inner = [m for m in module.layer.modules() if isinstance(m, FullyShardedDataParallel) and m is not module.layer]
    return inner[0] if inner else module.layer[0]


def _where(module: torch.nn.Module, frame: Any) -> Dict[str, Any]:
    """Where the main thread was when the signal handler ran: the function names of the stack, innermost first, and
    the state of the root FSDP instance (``None`` without FSDP)."""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return {"stack": names, "fsdp_state": str(getattr(module.layer, "training_state", None))}


class Signaller(Callback):
    """Global rank 0 signals every task inside the backward pass of the ``in_batch``-th training batch of this fit
    (0 is the first), or at the first batch of its first validation run once both tasks are in it
    (``in_validation``); ``on_signal`` runs on rank 0 just before. Records where each task was when Lightning's
    ``SIGUSR1`` handler ran, and when (and at which step) each validation run ended."""

    def __init__(
        self,
        out: Path,
        in_batch: Optional[int] = None,
        in_validation: bool = False,
        on_signal: Callable[[], None] = lambda: None,
    ) -> None:
        self.out, self.in_batch, self.in_validation, self.on_signal = out, in_batch, in_validation, on_signal
        self.batches, self.armed = 0, False
        self.received: List[Dict[str, Any]] = []
        self.validation_ends: List[Dict[str, Any]] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.hook = _first_block(pl_module).register_forward_hook(self._forward_hook)
        handler = signal.getsignal(signal.SIGUSR1)
        assert callable(handler), f"Lightning registered no SIGUSR1 handler: {handler}"

        def recording(signum: int, frame: Any) -> None:
            self.received.append(_where(pl_module, frame))
            handler(signum, frame)

        # Lightning's ``SignalConnector.teardown`` restores the handler of before the fit
        signal.signal(signal.SIGUSR1, recording)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.hook.remove()

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.armed = self.batches == self.in_batch
        self.batches += 1

    def _forward_hook(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if self.armed and torch.is_grad_enabled():
            self.armed = False
            output.register_hook(lambda grad: self._in_backward())

    def _in_backward(self) -> None:
        """Every task says it is at this point of its backward pass (a file each; no collective, which would meet
        the strategy's own ones in the middle of the pass), and global rank 0 signals once all are: each task then
        waits for the other's part of the pass, inside it."""
        folder = self.out / "in_backward"
        folder.mkdir(exist_ok=True)
        (folder / f"task{os.environ['SLURM_PROCID']}").touch()
        if os.environ["SLURM_PROCID"] != "0":
            return
        deadline = time.monotonic() + 60
        while len(list(folder.iterdir())) < int(os.environ["SLURM_NTASKS"]):
            assert time.monotonic() < deadline, "the other task never reached its backward pass"
            time.sleep(0.005)
        for path in folder.iterdir():
            path.unlink()
        self._signal()

    def _signal(self) -> None:
        self.on_signal()
        _signal_every_task(self.out)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int, _: int) -> None:
        if self.in_validation and not trainer.sanity_checking:
            self.in_validation = False
            trainer.strategy.barrier()  # both tasks are in the validation run
            if trainer.is_global_zero:
                self._signal()
            time.sleep(0.5)  # a long validation run

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.validation_ends.append({"time": time.time(), "step": trainer.global_step})


class RecordRestored(Callback):
    """The global step and every full parameter when training starts, i.e. after the restore."""

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step
        self.parameters = full_parameters(pl_module)  # collective


class FailingWrites:
    """While armed, the next ``os.pwrite`` of the main thread (the streamed save's) on global rank 0 raises
    ``ENOSPC``."""

    def __init__(self) -> None:
        self.armed = False
        original = os.pwrite

        def pwrite(*args: Any) -> int:
            if self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return original(*args)

        os.pwrite = pwrite


def _fit(folder: Path, strategy: Strategy, seed: int, max_epochs: int, signaller: Signaller, **kwargs: Any) -> Dict:
    seed_everything(seed)
    restored = RecordRestored()
    trainer = Trainer(
        **quiet_trainer_kwargs(
            folder,
            2,
            strategy=strategy,
            max_epochs=max_epochs,
            num_sanity_val_steps=0,
            callbacks=[signaller, restored],
            **{"limit_val_batches": 0, **kwargs},
        )
    )
    model = FSDPModel(width=16, units=3, batches=BATCHES)
    if not isinstance(strategy, DDPFullyShardedStrategy):
        model.configure_sharded_model()  # the layers exist before a DDP fit restores them
    trainer.fit(model)
    result: Dict[str, Any] = {
        "received": signaller.received,
        "validation_ends": signaller.validation_ends,
        "start_step": restored.step,
        "end_step": trainer.global_step,
    }
    checkpoint = folder / "hpc_ckpt_1.ckpt"
    if trainer.is_global_zero and restored.step:
        # the fit resumed, from the first HPC checkpoint: did it restore every parameter?
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
        full = restored.parameters
        result["restore_mismatches"] = sorted(k for k in full if k not in saved or not torch.equal(full[k], saved[k]))
        result["restored_keys"] = len(full)
    if trainer.is_global_zero:
        result["files"] = sorted(os.listdir(folder))
        result["sha256"] = {p.name: sha256(p) for p in sorted(folder.glob("hpc_ckpt_*.ckpt"))}
    return result


def _case(out: Path, name: str, strategy: Callable[[], Strategy], first: Dict, second: Dict) -> Dict[str, Any]:
    """A fit signalled mid-backward, then one resumed in the same folder; both with the given arguments of
    :class:`Signaller` and ``Trainer``."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["FAKE_SCONTROL_DIR"] = str(folder)
    fits = []
    for seed, max_epochs, options in ((1, 1, first), (2, 2, second)):
        options = dict(options)
        signaller = Signaller(out, **options.pop("signaller"))
        fits.append(_fit(folder, strategy(), seed, max_epochs, signaller, **options))
    requeues = (folder / "scontrol.jsonl").read_text().splitlines() if (folder / "scontrol.jsonl").exists() else []
    return {"fits": fits, "scontrol": [json.loads(line) for line in requeues]}


def cases(args: argparse.Namespace) -> Dict[str, Any]:
    (args.out / "pids").mkdir(parents=True, exist_ok=True)
    (args.out / "pids" / f"task{os.environ['SLURM_PROCID']}").write_text(str(os.getpid()))
    failing = FailingWrites()
    slow_background = InWriterThread(os, "pwrite", 0, lambda *args: time.sleep(0.1))

    def arm_failure() -> None:
        failing.armed = True

    # name: (strategy, the first fit's and the resumed fit's arguments); the FSDP faults and slowed writes are those
    # of global rank 0 writing the streamed file alone, hence ``checkpoint_writers="rank0"`` (the default is "auto")
    specs: Dict[str, Tuple[Callable[[], Strategy], Dict, Dict]] = {
        "fsdp-stream": (
            lambda: CPUFullyShardedStrategy(checkpoint_writers="rank0"),
            {"signaller": {"in_batch": SIGNALLED_BATCH}},
            {"signaller": {"in_batch": 0, "on_signal": arm_failure}},
        ),
        "fsdp-async": (
            lambda: CPUFullyShardedStrategy(async_checkpoint=True, checkpoint_writers="rank0"),
            {"signaller": {"in_batch": SIGNALLED_BATCH}},
            {"signaller": {}},
        ),
        "ddp": (
            lambda: DDPStrategy(process_group_backend="gloo"),
            {"signaller": {"in_batch": SIGNALLED_BATCH}},
            {"signaller": {"in_validation": True}, "limit_val_batches": 2, "val_check_interval": VAL_CHECK_INTERVAL},
        ),
    }
    result: Dict[str, Any] = {}
    for name in args.cases:
        slow_background.armed = name == "fsdp-async"
        result[name] = _case(args.out, name, *specs[name])
    return result


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)


if __name__ == "__main__":
    main({"cases": cases}, _add_arguments)
