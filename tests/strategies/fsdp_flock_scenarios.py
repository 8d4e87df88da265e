"""FSDP checkpoints on filesystems where ``flock`` fails, on CPU FSDP (2 ranks over gloo):
``python -m tests.strategies.fsdp_flock_scenarios <scenario> --flock KIND --out DIR``.

Every rank makes ``flock`` fail as the filesystem ``--flock`` does (``tests/helpers/flock_faults.py``: NFSv3 without
a lock daemon, Lustre without ``flock``, NFS's byte-range emulation of it) before anything else runs.

- ``killed_mid_save``: fit, save ``ckpts/last.ckpt`` (streamed), then save over it again; global rank 0 is killed
  (``SIGKILL``) once the file's structure is written, when it flushes it to disk.
- ``restarted``: the job started again: resume from ``ckpts/last.ckpt`` (whose load removes the killed save's
  temporary file), then, with ``flock`` failing as on each filesystem in turn, save streamed and gathered
  (``stream_checkpoint=False``). Rank 0 compares the two files of each filesystem entry by entry.

Driven by ``test_ddp_fully_sharded_flock.py``.
"""
import argparse
import json
import os
import signal
from typing import Any, Dict

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer, seed_everything
from tests.helpers import flock_faults
from tests.strategies.fsdp_stream_scenarios import differences, load


def _trainer(args: argparse.Namespace, **kwargs: Any) -> Trainer:
    defaults = dict(strategy=CPUFullyShardedStrategy(), max_epochs=1, limit_val_batches=0)
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **kwargs}))


def _model() -> FSDPModel:
    return FSDPModel(width=16, units=2, batches=2, optimizer="adam")


def _temporary_files(args: argparse.Namespace) -> list:
    return sorted(p.name for p in (args.out / "ckpts").glob("*.tmp"))


def killed_mid_save(args: argparse.Namespace) -> Dict[str, Any]:
    seed_everything(1)
    trainer = _trainer(args)
    trainer.fit(_model())
    path = args.out / "ckpts" / "last.ckpt"
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        facts = {"pid": os.getpid(), "last": path.read_bytes().hex()[:64], "size": path.stat().st_size}
        (args.out / "facts.json").write_text(json.dumps(facts))

        def killed(*_: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        os.fdatasync = os.fsync = killed
    trainer.save_checkpoint(path)
    return {"rank": trainer.global_rank, "survived": True}


class _RecordsFilesAtStart(Callback):
    """The temporary files of the checkpoint folder when training resumes, i.e. once the checkpoint is loaded."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.files = args, None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.files = _temporary_files(self.args)


def restarted(args: argparse.Namespace) -> Dict[str, Any]:
    seed_everything(2)
    ckpts = args.out / "ckpts"
    result: Dict[str, Any] = {"before_resume": _temporary_files(args)}
    recorder = _RecordsFilesAtStart(args)
    trainer = _trainer(args, max_epochs=2, callbacks=[recorder])
    trainer.fit(_model(), ckpt_path=str(ckpts / "last.ckpt"))
    result.update(rank=trainer.global_rank, at_resume=recorder.files, global_step=trainer.global_step)
    for kind in flock_faults.KINDS:
        flock_faults.install(kind)
        for streamed in (True, False):
            trainer.strategy.stream_checkpoint = streamed
            trainer.save_checkpoint(ckpts / f"{kind}-{'streamed' if streamed else 'gathered'}.ckpt")
            if streamed:
                # ``None``: this save was streamed (a reason why not would be kept here)
                result[f"stream_reason-{kind}"] = trainer.strategy._checkpoint_state.last_stream_reason
        if trainer.global_rank == 0:
            streamed_file, gathered_file = load(ckpts / f"{kind}-streamed.ckpt"), load(ckpts / f"{kind}-gathered.ckpt")
            result[f"differences-{kind}"] = differences(streamed_file, gathered_file)
            result[f"state_dict-{kind}"] = len(gathered_file["state_dict"])
    flock_faults.install(args.flock)
    result["after"] = _temporary_files(args)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flock", choices=flock_faults.KINDS, required=True)


if __name__ == "__main__":
    scenarios = {"killed_mid_save": killed_mid_save, "restarted": restarted}

    def with_failing_flock(run: Any) -> Any:
        def scenario(args: argparse.Namespace) -> Dict[str, Any]:
            flock_faults.install(args.flock)
            return run(args)

        return scenario

    main({name: with_failing_flock(run) for name, run in scenarios.items()}, add_arguments)
