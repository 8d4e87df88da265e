"""What ``DDPFullyShardedStrategy``'s ranks exchange for checkpoints over their gloo group, on CPU FSDP (2 ranks over
gloo): ``python -m tests.strategies.fsdp_checkpoint_group_scenarios <scenario> --out DIR``.

- ``host_memory``: every rank reads its host memory from a fake ``/proc`` and cgroup filesystem (``--proc``, made by
  the test with ``tests/helpers/fake_proc.py``: both ranks in one Slurm-like job cgroup on a host with plenty of
  ``MemAvailable``). Global rank 0 sets the job's limit before each save, to a multiple of the model's state dict
  ``S``, and every rank reports whether the save raised. Then, with ``flatten_parameters=False``, a save gathers every
  rank's optimizer state on global rank 0: every rank records the tensors it sends or receives (their device, and
  whether over the checkpoint group) and its own optimizer state, which the test compares with the file.
- ``gloo_group_fails``: during ``setup``, gloo on global rank 1 is pointed at a network interface it cannot use
  (``GLOO_SOCKET_IFNAME``), while the default process group works, as NCCL does over InfiniBand for a job whose host
  names resolve to an address the other nodes cannot reach. Global rank 1 cannot create the checkpoint group, global
  rank 0 times out waiting for it (``PL_CHECKPOINT_TIMEOUT``, set short by the scenario). Every rank reports what
  ``fit`` raised. Then the same job with ``PL_CHECKPOINT_GLOO_GROUP=0`` trains, saves, and a save that fails on
  global rank 0 raises on every rank.
- ``arrival``: with ``PL_CHECKPOINT_ARRIVAL_TIMEOUT`` set short by the scenario, global rank 1 calls
  ``trainer.save_checkpoint`` later than global rank 0, but within the bound; then global rank 0 calls it alone, as
  under ``if trainer.is_global_zero:``, while global rank 1 waits in a barrier of the default process group; then both
  call it (the checkpoint group is closed on rank 0 now); then ``trainer.validate`` sets up again and both save. Every
  rank reports each save's outcome, how long it took, and what its checkpoint group is after it.

The test runs the three in one launch (``fsdp_harness.runner.ScenarioBatch``), ``gloo_group_fails`` last. So each
scenario sets the environment variables it needs itself, on every rank, before its first ``Trainer`` reads them (they
are read when the strategy sets up and when it saves, not at import), and restores them, and the fake ``/proc`` of
``host_memory`` is only read during that scenario.

Driven by ``test_ddp_fully_sharded_checkpoint_group.py``.
"""
import argparse
import errno
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional
from unittest import mock

import torch
import torch.distributed.distributed_c10d as c10d

import pytorch_lightning.utilities.host_memory as host_memory
from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.exceptions import CheckpointError
from pytorch_lightning.utilities.types import _PATH
from tests.helpers.fake_proc import FakeProc

WIDTH, UNITS = 64, 2
#: bytes of the model's full state dict (fp32 parameters of ``UNITS`` linear layers, no buffers)
S = 4 * UNITS * (WIDTH * WIDTH + WIDTH)
GIB = 2**30


def _trainer(args: argparse.Namespace, strategy: CPUFullyShardedStrategy, **kwargs: Any) -> Trainer:
    defaults = dict(strategy=strategy, max_epochs=1, limit_val_batches=0)
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **kwargs}))


def _fit(args: argparse.Namespace, strategy: CPUFullyShardedStrategy, **kwargs: Any) -> Trainer:
    seed_everything(1)
    trainer = _trainer(args, strategy, **kwargs)
    trainer.fit(FSDPModel(width=WIDTH, units=UNITS, batches=2, optimizer="adam"))
    return trainer


def _save(trainer: Trainer, path: Path, **kwargs: Any) -> Optional[str]:
    """``None`` if the save succeeded, else the ``CheckpointError``'s message."""
    try:
        trainer.save_checkpoint(path, **kwargs)
    except CheckpointError as error:
        return str(error)
    return None


def host_memory_scenario(args: argparse.Namespace) -> Dict[str, Any]:
    with mock.patch.object(host_memory, "PROC_ROOT", str(Path(args.proc) / "proc")):
        return _host_memory(args, FakeProc(Path(args.proc), create=False))


def _host_memory(args: argparse.Namespace, fake: FakeProc) -> Dict[str, Any]:
    result: Dict[str, Any] = {"S": S}

    def save_with_headroom(trainer: Trainer, name: str, headroom: float, **kwargs: Any) -> None:
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            fake.set_job_memory(limit=GIB + int(headroom * S), usage=GIB)
        trainer.strategy.barrier()
        path = args.out / f"{name}.ckpt"
        result[name] = _save(trainer, path, **kwargs)
        result[f"{name}-written"] = path.exists()

    trainer = _fit(args, CPUFullyShardedStrategy())
    result["rank"] = trainer.global_rank
    # global rank 0 holds the state dict (S) and Adam's consolidated state (2 S)
    trainer.strategy.stream_checkpoint = False
    save_with_headroom(trainer, "gathered-2S", 2)
    save_with_headroom(trainer, "weights-only-2S", 2, weights_only=True)
    save_with_headroom(trainer, "gathered-3.5S", 3.5)
    # a streamed save holds about one FSDP unit
    trainer.strategy.stream_checkpoint = True
    save_with_headroom(trainer, "streamed-0.5S", 0.5)
    result["streamed-reason"] = trainer.strategy._checkpoint_state.last_stream_reason

    # every rank holds the state dict: the ranks of the job add up
    trainer = _fit(args, CPUFullyShardedStrategy(state_dict_on_rank_0_only=False))
    save_with_headroom(trainer, "every-rank-1.5S", 1.5, weights_only=True)
    save_with_headroom(trainer, "every-rank-2.5S", 2.5, weights_only=True)

    # every rank's own optimizer state, gathered on global rank 0
    fake.set_job_memory(limit=None, usage=GIB)
    strategy = CPUFullyShardedStrategy(flatten_parameters=False)
    trainer = _fit(args, strategy)
    sent: List[Dict[str, Any]] = []
    originals = {"send": c10d.send, "recv": c10d.recv}

    def recording(name: str) -> Any:
        def p2p(tensor: torch.Tensor, *a: Any, group: Any = None, **k: Any) -> Any:
            checkpoint_group = group is not None and group is strategy._checkpoint_state.checkpoint_group
            sent.append({"op": name, "device": tensor.device.type, "checkpoint_group": checkpoint_group})
            return originals[name](tensor, *a, group=group, **k)

        return p2p

    c10d.send, c10d.recv = recording("send"), recording("recv")
    try:
        result["per-rank"] = _save(trainer, args.out / "per-rank.ckpt")
    finally:
        c10d.send, c10d.recv = originals["send"], originals["recv"]
    result["p2p"] = sent
    own = trainer.optimizers[0].state_dict()["state"]
    result["own_state"] = _checksums(own)
    if trainer.global_rank == 0:
        saved = torch.load(args.out / "per-rank.ckpt", weights_only=False)["optimizer_states"][0]["fsdp_per_rank"]
        result["saved_states"] = [_checksums(state["state"]) for state in saved]
    return result


def _checksums(state: Dict[int, Dict[str, Any]]) -> Dict[str, float]:
    return {
        f"{index}/{name}": float(value.double().sum()) + value.numel()
        for index, buffers in state.items()
        for name, value in buffers.items()
        if torch.is_tensor(value)
    }


class UnreachableGlooInterface(CPUFullyShardedStrategy):
    """On global rank 1, gloo is told to use a network interface that does not exist while ``setup`` runs, which
    creates the checkpoint group; the default process group (and FSDP's own, created before) work."""

    def setup(self, trainer: Trainer) -> None:
        if self.global_rank == 1:
            os.environ["GLOO_SOCKET_IFNAME"] = "pl_no_such_if0"
        try:
            super().setup(trainer)
        finally:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


class FullDiskIO(TorchCheckpointIO):
    """Fails the second save on global rank 0, as a full disk does."""

    def __init__(self) -> None:
        self.saves = 0

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        self.saves += 1
        if self.saves == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().save_checkpoint(checkpoint, path, storage_options)


def gloo_group_fails(args: argparse.Namespace) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    start = time.monotonic()
    try:
        trainer = _fit(args, UnreachableGlooInterface())
        result["rank"], result["raised"] = trainer.global_rank, None
    except Exception as error:
        result["raised"] = f"{type(error).__name__}: {error}"
    result["seconds"] = time.monotonic() - start

    # the documented way out: the checkpoint failures go over the default process group
    with mock.patch.dict(os.environ, {"PL_CHECKPOINT_GLOO_GROUP": "0"}):
        strategy = UnreachableGlooInterface(stream_checkpoint=False)
        trainer = _fit(args, strategy, plugins=[FullDiskIO()])
        result.update(rank=trainer.global_rank, global_step=trainer.global_step)
        result["checkpoint_group"] = repr(strategy._checkpoint_state.checkpoint_group)
        result["saved"] = _save(trainer, args.out / "saved.ckpt")
        result["full_disk"] = _save(trainer, args.out / "full-disk.ckpt")
    return result


def _timed_save(trainer: Trainer, path: Path) -> Dict[str, Any]:
    start = time.monotonic()
    raised = _save(trainer, path)
    group = type(trainer.strategy._checkpoint_state.checkpoint_group).__name__
    return {"raised": raised, "seconds": time.monotonic() - start, "group": group, "written": path.exists()}


def arrival(args: argparse.Namespace) -> Dict[str, Any]:
    model = FSDPModel(width=WIDTH, units=UNITS, batches=2, optimizer="adam")
    seed_everything(1)
    trainer = _trainer(args, CPUFullyShardedStrategy())
    trainer.fit(model)
    rank = trainer.global_rank
    result: Dict[str, Any] = {"rank": rank}
    if rank == 1:
        time.sleep(ARRIVAL_SECONDS / 2)  # late, but within the bound
    result["late"] = _timed_save(trainer, args.out / "late.ckpt")
    if rank == 0:
        # the Lightning 1.x mistake: the save is a collective under FSDP
        result["alone"] = _timed_save(trainer, args.out / "alone.ckpt")
    trainer.strategy.barrier()
    # both save now: the group that rank 0 closed is not used again
    result["closed"] = _timed_save(trainer, args.out / "closed.ckpt")
    # the next stage's setup replaces it on every rank
    trainer.validate(model, verbose=False)
    result["replaced"] = _timed_save(trainer, args.out / "replaced.ckpt")
    return result


#: ``PL_CHECKPOINT_ARRIVAL_TIMEOUT`` of ``arrival``
ARRIVAL_SECONDS = 3.0


def _with_env(scenario: Callable[[argparse.Namespace], Dict[str, Any]], **env: str) -> Callable:
    """``scenario`` with ``env`` set in ``os.environ`` while it runs (a batch's next scenario runs without)."""

    def run(args: argparse.Namespace) -> Dict[str, Any]:
        with mock.patch.dict(os.environ, env):
            return scenario(args)

    return run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proc", help="the fake /proc and cgroup filesystem (host_memory)")


if __name__ == "__main__":
    main(
        {
            "host_memory": host_memory_scenario,
            # short, so that global rank 0 gives up waiting for global rank 1's gloo address quickly
            "gloo_group_fails": _with_env(gloo_group_fails, PL_CHECKPOINT_TIMEOUT="5"),
            "arrival": _with_env(
                arrival, PL_CHECKPOINT_ARRIVAL_TIMEOUT=str(ARRIVAL_SECONDS), PL_CHECKPOINT_TIMEOUT="30"
            ),
        },
        add_arguments,
    )
