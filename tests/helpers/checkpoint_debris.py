"""What saves killed mid-write leave next to checkpoints (see ``pytorch_lightning/utilities/atomic_save.py``), by the
names the fork gives them, and other files a checkpoint folder may hold."""
import os
import subprocess
import time
from pathlib import Path
from typing import Dict

from pytorch_lightning.utilities.atomic_save import _writer_host_id

#: the host id of a writer on another machine (or in another PID namespace)
OTHER_HOST = "0123456789ab"

#: what a killed ``torch.save`` leaves: the beginning of a zip archive
TORCH_SAVE_START = b"PK\x03\x04" + bytes(1000)


def dead_pid() -> int:
    """The process id of a process that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def debris(folder: Path, name: str, age: float = 0.0, data: bytes = TORCH_SAVE_START) -> Path:
    """What a save killed mid-write leaves: the beginning of a ``torch.save`` zip, last modified ``age`` seconds ago."""
    path = folder / name
    path.write_bytes(data)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def local_temporary_name(target: str, pid: int, suffix: str = "0123abcd") -> str:
    """The temporary name of a save of ``target`` by process ``pid`` of this host."""
    return f"{target}.{_writer_host_id()}.{pid}.{suffix}.tmp"


def plant_hpc_debris(folder: Path) -> Dict[str, Path]:
    """Next to HPC checkpoints: a save killed on another node (kept for 24 hours), one killed on this host (its writer
    is gone, so the next save or load removes it), one named by an earlier fork revision (kept for 24 hours), a
    user's copy and another checkpoint whose names contain ``hpc_ckpt_`` or ``ckpt_``. By kind."""
    return {
        "other host": debris(folder, f"hpc_ckpt_2.ckpt.{OTHER_HOST}.4242.89abcdef.tmp"),
        "this host, writer dead": debris(folder, local_temporary_name("hpc_ckpt_3.ckpt", dead_pid())),
        "earlier fork revision": debris(folder, "hpc_ckpt_3.ckpt.0a1b2c3d.tmp"),
        "user's copy": debris(folder, "hpc_ckpt_backup.ckpt"),
        "other checkpoint": debris(folder, "my_ckpt_7.ckpt"),
    }
