"""Run a multi-process Lightning script as the user would, bounded by a timeout.

Lightning 1.6's DDP launcher starts ranks >= 1 by re-running the command line of rank 0, so every multi-process
scenario is its own ``python -m <module>`` invocation. It runs in a new process session, so when rank 0 exits or
the timeout expires the whole group (every rank) is killed: a hang fails the test instead of stalling CI.
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a job's ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptResult(NamedTuple):
    returncode: int
    output: str
    seconds: float
    timed_out: bool


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def run_module(
    module: str,
    args: List[str],
    timeout: float = 120,
    grace: float = 15,
    env: Optional[Dict[str, str]] = None,
    path_first: Sequence[Path] = (),
) -> ScriptResult:
    """Run ``python -m module *args`` from the repository root; kill every rank on timeout or after rank 0 exits.

    ``grace`` is how long the other ranks may outlive rank 0 before they are killed. ``path_first``: folders the
    ranks import from before anything else, e.g. another build of ``pytorch_lightning``. ``python -m`` would put the
    working directory (the repository root, which holds the fork's own ``pytorch_lightning/``) ahead of them, so
    then the ranks run with ``PYTHONSAFEPATH=1`` (which Lightning's launcher passes on to ranks >= 1 with the rest
    of the environment) and find the repository root on ``PYTHONPATH``, after those folders.
    """
    full_env = dict(os.environ)
    front = [str(Path(p).resolve()) for p in path_first]
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [*front, str(ROOT), full_env.get("PYTHONPATH")]))
    if front:
        full_env["PYTHONSAFEPATH"] = "1"
    full_env.update(env or {})
    return _run_processes(module, args, [full_env], timeout, grace)


def run_tasks(module: str, args: List[str], envs: List[Dict[str, str]], timeout: float = 120) -> ScriptResult:
    """Run ``python -m module *args`` from the repository root once per environment in ``envs``, all at once, as a
    cluster's launcher (Slurm's ``srun``) starts one process per task; kill every task on timeout. The return code
    is the first task's that is not 0, else 0.

    Args:
        module: the module to run.
        args: its arguments, the same for every task.
        envs: the complete environment of each task; the repository root is added to ``PYTHONPATH``.
        timeout: seconds until every task is killed.
    """
    envs = [dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))) for env in envs]
    return _run_processes(module, args, envs, timeout, grace=30)


def _run_processes(
    module: str, args: List[str], envs: List[Dict[str, str]], timeout: float, grace: float
) -> ScriptResult:
    """One ``python -m module *args`` per environment, each in a new process session with the processes it starts;
    every session is killed on timeout, or ``grace`` seconds after every process exited or one failed."""
    # Ranks >= 1 inherit these descriptors; a file (not a pipe) never blocks them and needs no reader thread.
    with tempfile.TemporaryFile("w+") as log:
        start = time.monotonic()
        procs: List[subprocess.Popen] = []
        for env in envs:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=ROOT,
                    env={"PYTHONUNBUFFERED": "1", **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        timed_out = False
        # until every process exited or one failed; a failed one's peers get ``grace`` to fail too
        while any(code is None for code in _codes(procs)) and not any(code for code in _codes(procs)):
            if time.monotonic() - start > timeout:
                timed_out = True
                break
            time.sleep(0.1)
        deadline = time.monotonic() + (0 if timed_out else grace)
        while any(_group_alive(proc.pid) for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in procs:
            if _group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        seconds = time.monotonic() - start
        log.seek(0)
        output = log.read()
    returncode = next((code for code in _codes(procs) if code), 0)
    return ScriptResult(returncode, output, seconds, timed_out)


def _codes(procs: List[subprocess.Popen]) -> List[Optional[int]]:
    return [proc.poll() for proc in procs]


def assert_success(result: ScriptResult) -> None:
    assert not result.timed_out, f"timed out after {result.seconds:.0f}s; output:\n{result.output[-8000:]}"
    assert result.returncode == 0, f"exit code {result.returncode}; output:\n{result.output[-8000:]}"
