"""``srun`` on one machine: start ``--ntasks`` copies of a command, each with the variables SLURM gives a task of a
batch job, so that Lightning detects ``SLURMEnvironment`` (``SLURM_NTASKS`` equal to the devices requested, a job
name other than ``bash``) and takes every rank from SLURM (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``)
instead of starting processes itself. Like ``srun --kill-on-bad-exit=1``, a task that fails ends the others.

Run as ``python -m tests.helpers.fake_srun --ntasks 2 -- -m some.module args...``: the command after ``--`` is run
by this Python interpreter. The exit status is the first failing task's, else 0. ``MASTER_PORT`` is a free port
(SLURM jobs derive one from the job id, which parallel tests would share).
"""
import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_environment(procid: int, ntasks: int, job_id: str, port: int) -> Dict[str, str]:
    """The environment of task ``procid`` of a one-node job of ``ntasks`` tasks."""
    env = dict(os.environ)
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK"):
        env.pop(name, None)  # what another launcher would set; srun does not
    env.update(
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NAME="train",
        SLURM_NTASKS=str(ntasks),
        SLURM_NTASKS_PER_NODE=str(ntasks),
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_NODELIST="127.0.0.1",
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(procid),
        MASTER_PORT=str(port),
    )
    return env


def run(command: List[str], ntasks: int, job_id: str) -> int:
    port = _free_port()
    tasks = [
        subprocess.Popen([sys.executable, *command], env=task_environment(procid, ntasks, job_id, port))
        for procid in range(ntasks)
    ]
    while True:
        codes = [task.poll() for task in tasks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            break
        time.sleep(0.1)
    for task in tasks:
        if task.poll() is None:
            task.kill()  # Lightning's SLURM handler ignores SIGTERM
        task.wait()
    return failed[0] if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ntasks", type=int, default=2)
    parser.add_argument("--job-id", default="4242")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.exit(run(command, args.ntasks, args.job_id))
