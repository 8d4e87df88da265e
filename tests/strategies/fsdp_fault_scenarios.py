"""Checkpoint fault scenarios on CPU FSDP (2 ranks over gloo): ``python -m tests.strategies.fsdp_fault_scenarios``.

Each scenario injects one fault into checkpoint saving or loading. Scenarios that are expected to fail let the
exception escape, so the process exits non-zero; ``fsdp_harness.scenario.main`` writes the traceback of each rank to
``<out>/rank<N>.error``. With ``--caught`` the exception is caught at the top of the scenario instead (nothing after
the raise runs): the record holds its traceback and the time of the raise, and the next scenario of a batch runs in
the same processes (one launch for many faults, as in the collective-fault tests). Facts the driving test needs
(hashes of files before the fault, the time of the fault) are written by rank 0 to ``<out>/facts.json`` before the
fault happens. Driven by ``test_ddp_fully_sharded_faults.py``.
"""
import argparse
import errno
import functools
import hashlib
import json
import os
import shutil
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from fsdp_harness.corrupt_checkpoint import KINDS, make_bad_checkpoint
from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.types import _PATH
from tests.helpers.optimizer_models import SGDModel


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoint_hashes(folder: Path) -> Dict[str, str]:
    return {p.name: sha256(p) for p in sorted(folder.glob("*.ckpt"))}


def write_facts(args: argparse.Namespace, **facts: Any) -> None:
    path = args.out / "facts.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old.update(facts)
    path.write_text(json.dumps(old, indent=1, sort_keys=True))


def type_names(cls: type) -> list:
    return [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__]


@contextmanager
def recording_error_type(args: argparse.Namespace) -> Iterator[None]:
    """Write the classes of the exception that escapes (and of its ``__cause__``) to ``<out>/rank<N>.types.json``, so
    that the test can check which ``except`` clauses catch it on each rank."""
    try:
        yield
    except BaseException as err:
        cause = err.__cause__
        types = {"error": type_names(type(err)), "cause": type_names(type(cause)) if cause is not None else None}
        (args.out / f"rank{global_rank()}.types.json").write_text(json.dumps(types, indent=1))
        raise


class FailingCheckpointIO(TorchCheckpointIO):
    """Raises ``OSError(ENOSPC)`` on global rank 0 for the saves that ``should_fail`` selects, before any byte of the
    file is written, so whatever was at the target path before must still be there afterwards.

    Args:
        args: the scenario's arguments; the hashes of the checkpoint folder are recorded just before the fault.
        should_fail: called with the 1-based number of the save and its path.
        error: the exception to raise (``OSError(ENOSPC)`` by default).
    """

    def __init__(self, args: argparse.Namespace, should_fail, error: Optional[BaseException] = None) -> None:
        self.args, self.should_fail, self.saves = args, should_fail, 0
        self.error = error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        self.saves += 1
        if self.should_fail(self.saves, Path(path)):
            folder = Path(path).parent
            write_facts(self.args, failed_path=str(path), before=checkpoint_hashes(folder), fault_time=time.time())
            raise self.error
        super().save_checkpoint(checkpoint, path, storage_options)


class RankFailingLoadIO(TorchCheckpointIO):
    """Records on rank 0 when loading starts, and fails ``load_checkpoint`` on global rank ``rank`` only (e.g. a node
    that sees a stale or missing file)."""

    def __init__(self, args: argparse.Namespace, rank: Optional[int] = None) -> None:
        self.args, self.rank = args, rank

    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = None) -> Dict[str, Any]:
        if global_rank() == 0:
            write_facts(self.args, fault_time=time.time())
        if global_rank() == self.rank:
            raise FileNotFoundError(errno.ENOENT, "injected: checkpoint not visible on this node", str(path))
        return super().load_checkpoint(path, map_location)


def caught(scenario: Callable[[argparse.Namespace], Dict[str, Any]]) -> Callable[[argparse.Namespace], Dict[str, Any]]:
    """``scenario``, whose exception is caught and recorded with ``--caught`` (see the module's docstring)."""

    @functools.wraps(scenario)
    def run(args: argparse.Namespace) -> Dict[str, Any]:
        if not args.caught:
            return scenario(args)
        try:
            return scenario(args)
        except Exception:
            return {"rank": global_rank(), "raised_time": time.time(), "error": traceback.format_exc()}

    return run


def prepare_bad_checkpoint(args: argparse.Namespace) -> None:
    """Rank 0 makes the ``--bad`` kind of checkpoint at ``--ckpt`` from the good one at ``--good`` (``good``: a copy);
    the other ranks wait for it (by a marker file, since no process group need exist yet) before they load it."""
    ready = args.out / "bad_checkpoint_ready"
    if global_rank() == 0:
        if args.bad == "good":
            shutil.copyfile(args.good, args.ckpt)
        else:
            make_bad_checkpoint(args.bad, args.good, args.ckpt)
        ready.touch()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, f"rank 0 did not make {args.ckpt}"
        time.sleep(0.01)


def trainer_kwargs(args: argparse.Namespace, **overrides: Any) -> Dict[str, Any]:
    defaults = {"strategy": CPUFullyShardedStrategy(), "max_epochs": 1, "limit_val_batches": 0}
    return quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **overrides})


def save_fails(args: argparse.Namespace) -> Dict[str, Any]:
    """``trainer.save_checkpoint`` twice to the same path; the second write fails on rank 0 (ENOSPC, or a custom
    CheckpointIO exception with ``--error custom``). With ``--error notadir`` the second save goes through the real
    ``TorchCheckpointIO`` to ``ckpts/blocker/model.ckpt``, where ``blocker`` is a regular file."""
    seed_everything(1)
    model = FSDPModel(width=8, units=2, batches=2)
    error = RuntimeError("injected failure of a custom CheckpointIO") if args.error == "custom" else None
    io = FailingCheckpointIO(args, lambda n, path: n == 2 and args.error != "notadir", error=error)
    trainer = Trainer(**trainer_kwargs(args, plugins=[io]))
    trainer.fit(model)
    path = args.out / "ckpts" / "model.ckpt"
    path.parent.mkdir(exist_ok=True)
    trainer.save_checkpoint(path)
    if args.error == "notadir":
        trainer.strategy.barrier()
        blocked = path.parent / "blocker" / "model.ckpt"
        if trainer.is_global_zero:
            blocked.parent.write_text("not a directory")
            write_facts(args, failed_path=str(blocked), before=checkpoint_hashes(path.parent), fault_time=time.time())
        with recording_error_type(args):
            trainer.save_checkpoint(blocked)
    with recording_error_type(args):
        trainer.save_checkpoint(path)  # fails on rank 0 and must raise on every rank
    return {"rank": trainer.global_rank, "survived": True}


def fit_checkpoint_fails(args: argparse.Namespace) -> Dict[str, Any]:
    """``ModelCheckpoint`` with top-k pruning and ``save_last`` saves after every step; the save selected by
    ``--fail-on`` fails on rank 0 during ``fit``."""
    seed_everything(1)
    model = FSDPModel(width=8, units=2, batches=8)
    dirpath = args.out / "ckpts"
    if args.fail_on == "topk":
        # saves alternate top-k, last; the 4th top-k save (7th save) has to prune the oldest of the top 2
        should_fail = lambda n, path: n == 7  # noqa: E731
    else:
        should_fail = lambda n, path: n == 6 and path.name == "last.ckpt"  # noqa: E731
    callback = ModelCheckpoint(
        dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True, every_n_train_steps=1
    )
    plugins = [FailingCheckpointIO(args, should_fail)]
    trainer = Trainer(**trainer_kwargs(args, plugins=plugins, callbacks=[callback], enable_checkpointing=True))
    trainer.fit(model)
    return {"rank": trainer.global_rank, "survived": True}


def resume_bad(args: argparse.Namespace) -> Dict[str, Any]:
    """``fit(ckpt_path=...)`` from the file at ``--ckpt`` (prepared by the test, or missing), or with a load that fails
    on global rank 1 only (``--ckpt`` a good checkpoint and ``--fail-load-rank 1``). With ``--bad`` the file at
    ``--ckpt`` is made here from ``--good`` (see :func:`prepare_bad_checkpoint`), for a batch that saves ``--good``
    in an earlier case."""
    if args.bad:
        prepare_bad_checkpoint(args)
    seed_everything(1)
    model = SGDModel()
    plugins = [RankFailingLoadIO(args, args.fail_load_rank)]
    trainer = Trainer(**trainer_kwargs(args, plugins=plugins, max_epochs=2, limit_train_batches=2))
    with recording_error_type(args):
        trainer.fit(model, ckpt_path=args.ckpt)
    return {"rank": trainer.global_rank, "survived": True, "global_step": trainer.global_step}


def save_good(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit ``BoringModel`` briefly and save a good checkpoint to ``--ckpt``, for the resume scenarios."""
    seed_everything(1)
    trainer = Trainer(**trainer_kwargs(args, limit_train_batches=2))
    trainer.fit(SGDModel())
    trainer.save_checkpoint(args.ckpt)
    return {"rank": trainer.global_rank}


class BigModel(SGDModel):
    """``SGDModel`` plus a large buffer, so that writing its checkpoint takes a while."""

    def __init__(self, megabytes: int) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(megabytes * 2**20 // 4))


def _kill_self_when_writing(folder: Path, started: threading.Event, args: argparse.Namespace) -> None:
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}
    started.set()
    while True:
        for p in list(folder.iterdir()):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if before.get(p.name) != (st.st_size, st.st_mtime_ns) and st.st_size > 2**20:
                write_facts(args, killed_while=p.name, killed_at_size=st.st_size, fault_time=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.001)


def killed_mid_save(args: argparse.Namespace) -> Dict[str, Any]:
    """Rank 0 is killed with SIGKILL while it writes a large checkpoint to ``ckpts/model.ckpt``; with ``--previous``
    a good (small) checkpoint was saved at that path first."""
    seed_everything(1)
    model = BigModel(args.megabytes)
    trainer = Trainer(**trainer_kwargs(args, limit_train_batches=1))
    trainer.fit(model)
    path = args.out / "ckpts" / "model.ckpt"
    path.parent.mkdir(exist_ok=True)
    if args.previous:
        trainer.save_checkpoint(path, weights_only=True)
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            write_facts(args, before=checkpoint_hashes(path.parent))
    else:
        trainer.strategy.barrier()
    if trainer.is_global_zero:
        started = threading.Event()
        threading.Thread(target=_kill_self_when_writing, args=(path.parent, started, args), daemon=True).start()
        started.wait()
    trainer.save_checkpoint(path)
    # only reached if the write finished before the watcher saw it
    return {"rank": trainer.global_rank, "survived": True}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--error", choices=["enospc", "custom", "notadir"], default="enospc")
    parser.add_argument("--fail-on", choices=["topk", "last"], default="topk")
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--fail-load-rank", type=int)
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--previous", action="store_true")
    parser.add_argument("--bad", choices=KINDS + ("good",), help="kind of checkpoint that resume_bad makes at --ckpt")
    parser.add_argument("--good", type=Path, help="the good checkpoint that --bad is made from")
    parser.add_argument("--caught", action="store_true", help="catch and record the scenario's exception")


if __name__ == "__main__":
    main(
        {
            "save_fails": caught(save_fails),
            "fit_checkpoint_fails": caught(fit_checkpoint_fails),
            "resume_bad": caught(resume_bad),
            "save_good": save_good,
            "killed_mid_save": killed_mid_save,
        },
        add_arguments,
    )
