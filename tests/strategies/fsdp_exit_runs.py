"""Resume, save and exit, many times: every rank of every run must exit with status 0.

``python -m tests.strategies.fsdp_exit_runs --out DIR --runs 30 --parallel 3`` runs :func:`user_script`, a plain
user's script (not a harness scenario: those destroy the process group before they return, which a user's script does
not do), as independent 2-rank CPU FSDP jobs over gloo, each in an empty folder of its own with a MASTER_PORT of its
own, several at once. A first job trains one epoch and saves ``last.ckpt`` (its exit is checked too), every other one
resumes from it (``Trainer.fit(ckpt_path=...)``), saves and ends. Half of them save in the background during ``fit``
(``async_checkpoint=True``), so that the fork's background-save group exists as well. ``DIR/statuses.json`` has every
rank's exit status (``-6``: SIGABRT) and the gloo threads the first job had left once the fork's exit hook ran;
``DIR/<job>/rank<N>.log`` its output. Driven by ``test_ddp_fully_sharded_exit.py``.

The abort this guards against (``terminate called without an active exception`` at interpreter exit) needs a gloo
worker thread that is still waiting for the GIL, to free the last collective of the save, when the interpreter
starts finalizing. Left to chance, that happened in 3 of 54 plain runs (``python script.py`` from an empty folder) on
2 cores. Right before the save, each rank makes it likely, as a busy node would: the gloo worker threads of every
group run at the lowest priority, on the core of the rank's main thread, and a thread waiting for the GIL asks for it
after 50 ms instead of 5 ms.

The ranks are forked from this process once it has imported everything, and are started as external launchers such
as ``torchrun`` start them (``LOCAL_RANK`` set): an interpreter with torch, Lightning and FairScale imported costs
seconds of CPU to start, which 60 ranks on the 2 cores of CI cannot afford. Each rank then runs and exits as a script
does: it returns to the top of this module and the interpreter finalizes. ``gc.freeze()`` before the forks keeps the
ranks' garbage collector away from the imported modules, which they share with this process, instead of copying all
their pages when it visits them at exit.
"""
import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch._inductor  # noqa: F401  (the Trainer imports it, through ``torch.use_deterministic_algorithms``)

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel
from fsdp_harness.multiprocess import free_port
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities import checkpoint_groups

WORLD_SIZE = 2
#: Seconds a job may take before its ranks are killed (it then counts as failed).
JOB_TIMEOUT = 120
#: How long a thread waiting for the GIL waits before it asks for it (Python's default is 5 ms).
SWITCH_INTERVAL = 0.05
GLOO_WORKER = "pt_gloo_runloop"


def user_script(folder: Path, resume_from: Optional[Path], async_checkpoint: bool) -> None:
    """What the user's script does: train (resuming from ``resume_from``), save ``folder/last.ckpt``, and end."""
    trainer = Trainer(
        strategy=CPUFullyShardedStrategy(async_checkpoint=async_checkpoint),
        max_epochs=1 if resume_from is None else 2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=str(folder / "epochs"), save_top_k=-1)],
        **quiet_trainer_kwargs(folder, WORLD_SIZE, enable_checkpointing=True),
    )
    # every layer is its own FSDP unit, inside an outer one
    trainer.fit(FSDPModel(width=8, units=2, batches=2), ckpt_path=None if resume_from is None else str(resume_from))
    (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps({"global_step": trainer.global_step}))
    _act_like_a_busy_node(trainer.global_rank)
    trainer.save_checkpoint(folder / "last.ckpt")


def _act_like_a_busy_node(rank: int) -> None:
    """Every thread of this rank on one core; the gloo workers at the lowest priority; a longer GIL switch interval."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, {core})
            if _thread_name(tid) == GLOO_WORKER:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        except ProcessLookupError:
            # the thread has ended
            pass
    sys.setswitchinterval(SWITCH_INTERVAL)


def _thread_ids() -> List[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _thread_name(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        # the thread has ended
        return ""


def _gloo_threads() -> Dict[str, int]:
    """The live gloo threads of this process, by name, the process groups ``torch.distributed`` still has, and how
    many of them the fork holds (its checkpoint group, its background-save group)."""
    names = [_thread_name(tid) for tid in _thread_ids()]
    groups = len(torch.distributed.distributed_c10d._world.pg_map) if torch.distributed.is_initialized() else 0
    return {"workers": names.count(GLOO_WORKER), "groups": groups, "fork_groups": len(checkpoint_groups._HELD)}


def _report_gloo_threads_at_exit(folder: Path, rank: int) -> Dict[str, int]:
    """Write ``folder/threads<rank>.json`` at exit: the gloo threads and groups left once the fork's exit hook has
    run (this one, registered before the Trainer exists, runs after it: atexit runs the last registered first), and
    those of the dict returned, which the caller fills before the script ends."""
    import atexit

    before: Dict[str, int] = {}

    def report() -> None:
        (folder / f"threads{rank}.json").write_text(json.dumps({"before": before, "after": _gloo_threads()}))

    atexit.register(report)
    return before


def _run_rank(folder: Path, rank: int, port: int, resume_from: Optional[Path], async_checkpoint: bool) -> int:
    """The body of a forked rank: an external launcher's environment, an empty working folder, the user's script."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD_SIZE), NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    os.chdir(folder)
    log = os.open(folder / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        if resume_from is None:
            before = _report_gloo_threads_at_exit(folder, rank)
            user_script(folder, resume_from, async_checkpoint)
            before.update(_gloo_threads())
        else:
            user_script(folder, resume_from, async_checkpoint)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


class _Job:
    def __init__(self, name: str, folder: Path, resume_from: Optional[Path], async_checkpoint: bool) -> None:
        self.name, self.folder, self.resume_from, self.async_checkpoint = name, folder, resume_from, async_checkpoint
        self.pids: Dict[int, int] = {}
        self.exit: List[Optional[int]] = [None] * WORLD_SIZE
        self.start = self.end = 0.0

    def launch(self) -> None:
        """Fork the ranks. In a rank, this raises ``SystemExit`` with its status: the rank unwinds to the top of the
        module and exits as a script does, through the interpreter's finalization."""
        self.folder.mkdir(parents=True)
        port = free_port()
        self.start = time.monotonic()
        for rank in range(WORLD_SIZE):
            pid = os.fork()
            if pid == 0:
                raise SystemExit(_run_rank(self.folder, rank, port, self.resume_from, self.async_checkpoint))
            self.pids[pid] = rank

    @property
    def done(self) -> bool:
        return None not in self.exit

    def kill_if_late(self) -> None:
        if time.monotonic() - self.start > JOB_TIMEOUT:
            for pid, rank in self.pids.items():
                if self.exit[rank] is None:
                    os.kill(pid, signal.SIGKILL)

    def result(self) -> Dict[str, Any]:
        steps = [self._read(f"rank{rank}.json", {}).get("global_step") for rank in range(WORLD_SIZE)]
        result = {"job": self.name, "exit": self.exit, "global_step": steps, "async": self.async_checkpoint}
        result["seconds"] = round(self.end - self.start, 1)
        result["logs"] = {rank: self._tail(rank) for rank, status in enumerate(self.exit) if status != 0}
        if self.resume_from is None:
            result["threads"] = [self._read(f"threads{rank}.json", None) for rank in range(WORLD_SIZE)]
        return result

    def _read(self, name: str, default: Any) -> Any:
        path = self.folder / name
        return json.loads(path.read_text()) if path.exists() else default

    def _tail(self, rank: int) -> str:
        path = self.folder / f"rank{rank}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _run_jobs(jobs: List[_Job], parallel: int) -> None:
    """Run ``jobs``, at most ``parallel`` at a time, and record every rank's exit status."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            job.launch()
            running.append(job)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for job in running:
                job.kill_if_late()
            time.sleep(0.05)
            continue
        job = next(job for job in running if pid in job.pids)
        job.exit[job.pids[pid]] = os.waitstatus_to_exitcode(status)
        if job.done:
            job.end = time.monotonic()
            running.remove(job)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--parallel", type=int, default=3)
    args = parser.parse_args()
    # a process with other threads must not fork: they would be missing in the ranks, holding whatever they held
    # (numpy's OpenBLAS starts a pool of threads on import unless OPENBLAS_NUM_THREADS=1)
    assert len(_thread_ids()) == 1, f"threads before forking: {len(_thread_ids())}; set OPENBLAS_NUM_THREADS=1"
    gc.freeze()
    start = time.monotonic()
    first = _Job("first", args.out / "first", None, async_checkpoint=True)
    _run_jobs([first], 1)
    runs = [
        _Job(f"run{index}", args.out / f"run{index}", first.folder / "last.ckpt", async_checkpoint=index % 2 == 0)
        for index in range(args.runs)
    ]
    _run_jobs(runs, args.parallel)
    results = {"first": first.result(), "runs": [job.result() for job in runs]}
    results["seconds"] = round(time.monotonic() - start, 1)
    (args.out / "statuses.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
