"""``srun`` on one machine: start ``--ntasks`` copies of a command, each with the variables SLURM gives a task of a
batch job, so that Lightning detects ``SLURMEnvironment`` (``SLURM_NTASKS`` equal to the devices requested, a job
name other than ``bash``) and takes every rank from SLURM (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``)
instead of starting processes itself. Like ``srun --kill-on-bad-exit=1``, a task that fails ends the others.

Run as ``python -m tests.helpers.fake_srun --ntasks 2 -- -m some.module args...``: the command after ``--`` is run
by this Python interpreter. The exit status is the first failing task's, else 0. ``MASTER_PORT`` is a free port
(SLURM jobs derive one from the job id, which parallel tests would share).
"""
import argparse
import subprocess
import sys
import time
from typing import List

from tests.helpers.fake_slurm import slurm_task_envs


def run(command: List[str], ntasks: int, job_id: str) -> int:
    envs = slurm_task_envs(ntasks, int(job_id), job_name="train")
    tasks = [subprocess.Popen([sys.executable, *command], env=env) for env in envs]
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
