"""A Slurm job step on this machine, as ``srun`` starts it: one process per task, each with the ``SLURM_*`` variables
``srun`` exports, and a fake ``scontrol`` on ``PATH`` that records each call and the HPC checkpoints as they are on
disk at that moment."""
import os
import stat
import sys
from pathlib import Path
from typing import Dict, List, Optional

from fsdp_harness.multiprocess import free_port

#: The variables Lightning's own launcher and torchelastic export; a task started by ``srun`` has none of them.
_LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")

_SCONTROL = '''#!{python}
"""Fake ``scontrol``: appends its arguments and what the newest ``hpc_ckpt_<N>.ckpt`` of ``$FAKE_SCONTROL_DIR`` (a
folder, or an fsspec URL such as ``s3://bucket/run``) holds at the moment it runs to ``scontrol.jsonl`` in
``$FAKE_SCONTROL_LOG`` (by default that folder)."""
import hashlib, json, os, re, sys, time

import fsspec

folder = os.environ["FAKE_SCONTROL_DIR"]
fs, root = fsspec.core.url_to_fs(folder)
fs.invalidate_cache()
# the listing first, before anything slow: what is stored when the job would be requeued
names = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
record = {{"argv": sys.argv[1:], "files": names, "time": time.time()}}
versions = sorted(int(m.group(1)) for m in map(re.compile(r"hpc_ckpt_(\\d+)\\.ckpt").fullmatch, names) if m)
if versions:
    path = root.rstrip("/") + f"/hpc_ckpt_{{versions[-1]}}.ckpt"
    record["newest"] = os.path.basename(path)
    with fs.open(path, "rb") as f:
        data = f.read()
    record["sha256"] = hashlib.sha256(data).hexdigest()
    try:
        import io

        import torch

        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        record.update(
            loads=True,
            keys=sorted(checkpoint),
            global_step=checkpoint["global_step"],
            state_dict=len(checkpoint["state_dict"]),
            optimizer_states=len(checkpoint["optimizer_states"]),
        )
    except Exception as error:
        record.update(loads=False, error=repr(error))
with open(os.path.join(os.environ.get("FAKE_SCONTROL_LOG", folder), "scontrol.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\\n")
'''


def install_fake_scontrol(bin_dir: Path) -> Path:
    """Writes the fake ``scontrol`` into ``bin_dir`` (to put first on ``PATH``); it runs with this interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "scontrol"
    path.write_text(_SCONTROL.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def slurm_task_envs(
    ntasks: int, job_id: int, bin_dir: Optional[Path] = None, job_name: str = "train-fsdp"
) -> List[Dict[str, str]]:
    """The environment of each task of a one-node job step of ``ntasks`` tasks, as ``srun`` starts them: this
    process's environment without the launcher variables, ``bin_dir`` (if any) first on ``PATH``, and the ``SLURM_*``
    variables ``SLURMEnvironment`` reads (the job name is not ``bash``, which Lightning takes for an interactive
    session). ``MASTER_PORT`` is a free port, so that parallel tests do not meet on the one derived from the job id."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    base.update(
        PATH=os.pathsep.join([str(bin_dir), base.get("PATH", "")]) if bin_dir else base.get("PATH", ""),
        MASTER_PORT=str(free_port()),
        SLURM_JOB_ID=str(job_id),
        SLURM_JOBID=str(job_id),
        SLURM_JOB_NAME=job_name,
        SLURM_NTASKS=str(ntasks),
        SLURM_NPROCS=str(ntasks),
        SLURM_NNODES="1",
        SLURM_NODELIST="localhost",
        SLURM_JOB_NODELIST="localhost",
        SLURM_TASKS_PER_NODE=str(ntasks),
        SLURM_STEP_ID="0",
        SLURM_NODEID="0",
    )
    return [dict(base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)) for rank in range(ntasks)]
