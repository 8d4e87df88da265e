"""Start the ranks of a scenario launch as forks of one interpreter that has imported torch, Lightning and FairScale.

``python -m fsdp_harness.forked_ranks --ranks N <module> <args...>`` imports the scenario module (and with it
everything it needs), then forks N ranks; ``--plan FILE`` runs several such launches of the module one after the
other from the same driver (the batches of one test module, :class:`fsdp_harness.runner.ScenarioBatches`). Each
rank gets an external launcher's environment, as ``torchrun`` or Slurm's ``srun`` start ranks (``LOCAL_RANK``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning starts no processes of its own, and runs ``<module>``
as ``__main__`` with ``<args>``, then exits as a script does:
the interpreter finalizes, running the exit hooks.

Why: an interpreter costs 4-5.5 s of CPU on CI's machine to import torch and Lightning, and a 2-rank launch of
``python -m <module>`` pays that twice (Lightning's launcher re-runs the command line for rank 1). Most of the suite's
launches are 2-rank scenario batches on the 2 cores of CI; forking the ranks of an imported interpreter pays it once.
Lightning's own launcher (``_SubprocessScriptLauncher``) still runs in the tests that run a user's script as the user
would (the README's quick start, the standalone script, the upstream PR's tests, the benchmark), and
``PL_HARNESS_LAUNCHER=lightning`` runs every scenario launch through it.

The driver exits with rank 0's status (a signal's as ``-signal`` through the same signal), as ``python -m <module>``
exits with rank 0's: the harness gives the other ranks, in the driver's process group, their grace and kills them.

What a forked rank shares with the others that fresh interpreters would not: the hash seed of ``str`` (so ``hash``,
and the iteration order of sets of strings, are the same on every rank: code that orders collectives by a set's
order would pass here and hang across nodes), the driver's ``OPENBLAS_NUM_THREADS=1`` (a process with threads must
not fork), and what the scenario module's code did at import in the driver (it runs again as ``__main__`` in each
rank: a scenario module must not patch, register handlers or start anything at import). And Lightning's launcher,
not used here, has its own behaviour on a failed ``fit`` (``reconciliate_processes``). Before a release the suite
also runs with ``PL_HARNESS_LAUNCHER=lightning`` (CONTRIBUTING.md), every rank a fresh interpreter.
"""
import argparse
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, NoReturn, Optional

from fsdp_harness.multiprocess import free_port

#: ``fork`` (the default): scenario launches of more than one rank fork them from this driver; ``lightning``: they
#: run ``python -m <module>`` and Lightning's launcher starts ranks >= 1.
LAUNCHER_ENV = "PL_HARNESS_LAUNCHER"

PR_SET_PDEATHSIG = 1

#: Environment variables read when a process starts (glibc's malloc tunables, the dynamic loader, Python itself,
#: the BLAS and OpenMP pools as their libraries load): a forked rank cannot be given its own, it has the driver's.
AT_EXEC = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "PYTHON", "OMP_", "OPENBLAS_", "MKL_")


def forks_ranks(devices: int) -> bool:
    """Whether a scenario launch of ``devices`` ranks goes through this driver."""
    return devices > 1 and os.environ.get(LAUNCHER_ENV, "fork") == "fork"


def driver_environment(env: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The extra environment of a driver started with ``env``: numpy's OpenBLAS pool would give it threads, and a
    process with threads must not fork."""
    return {"OPENBLAS_NUM_THREADS": "1", **(env or {})}


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _run_rank(rank: int, ranks: int, port: int, module: str, args: List[str], env: Dict[str, str]) -> NoReturn:
    """The body of a forked rank: ``env``, the environment an external launcher gives it, then the module as a
    script."""
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks)
    )
    # what a fresh interpreter computes from LOCAL_RANK as it imports them; the driver imported them as rank 0
    lightning = sys.modules.get("pytorch_lightning.utilities.rank_zero")
    if lightning is not None:
        lightning.rank_zero_only.rank = lightning._get_rank()
    torchmetrics = sys.modules.get("torchmetrics.utilities.prints")
    if torchmetrics is not None:
        torchmetrics.rank_zero_only.rank = rank
    # as under ``python -m``: the module runs as ``__main__`` only, and an import by name makes a module of its own
    del sys.modules[module]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def _exit_as(status: int) -> NoReturn:
    """Exit as rank 0 did (``status`` from ``os.waitpid``)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # their handlers are the default, and cannot be set
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


def _fork_ranks(
    ranks: int, module: str, args: List[str], env: Optional[Dict[str, str]] = None, own_group: bool = False
) -> List[int]:
    """Fork ``ranks`` ranks running ``module`` with ``args`` and the extra environment ``env`` (none of it read when
    a process starts: see ``AT_EXEC``); their pids, rank 0's first.

    ``own_group``: the ranks form a process group of their own, led by rank 0, as the ranks of one ``python -m``
    launch do (a scenario that kills ``os.getpgrp()`` kills them, not the driver, which runs the next launch of its
    plan), and each dies with the driver (``PR_SET_PDEATHSIG``): the harness kills the driver's group on timeout."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    driver, pids = os.getpid(), []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            if own_group:
                try:
                    os.setpgid(0, pids[0] if pids else 0)
                except OSError:
                    pass  # rank 0 is gone already: this rank stays in the driver's group
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != driver:  # the driver died before the request
                    os._exit(1)
            _run_rank(rank, ranks, port, module, args, env or {})
        if own_group:
            try:  # also here, so that the group exists before the next rank joins it, whichever runs first
                os.setpgid(pid, pids[0] if pids else pid)
            except OSError:
                pass  # the child did it already
        pids.append(pid)
    return pids


def _run_batch(ranks: int, module: str, args: List[str], env: Dict[str, str], grace: float) -> int:
    """One launch of a plan (see :func:`main`): its ranks, then rank 0's exit code once every rank is gone (the
    others get ``grace`` seconds after rank 0 exited, as the harness gives a launch's ranks, then are killed)."""
    pids = _fork_ranks(ranks, module, args, env, own_group=True)
    _, status = os.waitpid(pids[0], 0)
    deadline = time.monotonic() + grace
    for pid in pids[1:]:
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, help="fork this many ranks and exit as rank 0 does")
    parser.add_argument(
        "--plan",
        type=Path,
        help="a JSON list of launches, run one after the other: {ranks, args, env, status}; each one's rank 0 exit code"
        " and seconds are written to its status file (JSON), the next starts once every rank of the last is gone",
    )
    parser.add_argument("--grace", type=float, default=15, help="--plan: seconds ranks >= 1 may outlive rank 0")
    parser.add_argument("module")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if (options.ranks is None) == (options.plan is None):
        parser.error("give one of --ranks and --plan")
    # everything a rank imports, imported once here; a rank re-runs only the module's own code
    importlib.import_module(options.module)
    # a process with other threads must not fork: they would be missing in the ranks, holding what they held
    if _threads() != 1:
        raise RuntimeError(
            f"{_threads()} threads after the imports, cannot fork the ranks (OpenBLAS: OPENBLAS_NUM_THREADS=1)"
        )
    # the ranks' garbage collector then leaves the imported modules' pages shared instead of copying them
    gc.freeze()
    if options.ranks is not None:
        pids = _fork_ranks(options.ranks, options.module, options.args)
        _, status = os.waitpid(pids[0], 0)
        _exit_as(status)
    for launch in json.loads(options.plan.read_text()):
        start = time.monotonic()
        code = _run_batch(launch["ranks"], options.module, launch["args"], launch.get("env", {}), options.grace)
        status = {"returncode": code, "seconds": time.monotonic() - start}
        Path(launch["status"]).write_text(json.dumps(status))


if __name__ == "__main__":
    main()
