"""Temporary files of checkpoint saves that were killed mid-write are removed by the next save into the directory and
by every load from it; files that are not such debris, and saves still in flight, are left alone."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.atomic_save import remove_stale_temporary_files
from pytorch_lightning.utilities.cloud_io import atomic_save


def _debris(folder: Path, name: str = "model.ckpt.0123abcd.tmp") -> Path:
    """What a save killed mid-write leaves: the beginning of a ``torch.save`` zip, nobody holding its lock."""
    path = folder / name
    path.write_bytes(b"PK\x03\x04" + os.urandom(1000))
    return path


def test_next_save_removes_debris_of_killed_saves(tmp_path):
    stale = [_debris(tmp_path), _debris(tmp_path, "other.ckpt.deadbeef.tmp"), tmp_path / "empty.ckpt.00000000.tmp"]
    stale[-1].write_bytes(b"")
    atomic_save({"a": torch.ones(2)}, tmp_path / "model.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_cleanup_keeps_files_that_are_not_debris(tmp_path):
    keep = {
        "notes.tmp": b"PK\x03\x04",  # not our name
        "model.ckpt.tmp": b"PK\x03\x04",
        "model.ckpt.0123abcg.tmp": b"PK\x03\x04",  # not 8 hex digits
        "model.ckpt.0123abcd.tmp.bak": b"PK\x03\x04",
        "model.ckpt.0123ABCD.tmp": b"PK\x03\x04",
        "data.12345678.tmp": b"user data",  # our name, but not written by torch.save
    }
    for name, data in keep.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "dir.ckpt.0123abcd.tmp").mkdir()
    target = tmp_path / "elsewhere.ckpt"
    target.write_bytes(b"PK\x03\x04")
    (tmp_path / "link.ckpt.0123abcd.tmp").symlink_to(target)
    assert remove_stale_temporary_files(tmp_path) == []
    assert {p.name for p in tmp_path.iterdir()} == set(keep) | {"dir.ckpt.0123abcd.tmp", "elsewhere.ckpt", "link.ckpt.0123abcd.tmp"}


def test_cleanup_keeps_a_save_in_flight(tmp_path):
    """A temporary file whose lock another process holds (a save writing it right now) is not touched."""
    path = _debris(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR);"
         " fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        atomic_save({"a": 1}, tmp_path / "model.ckpt")
        assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    # its writer is gone (killed): now it is debris
    assert remove_stale_temporary_files(tmp_path) == [str(path)]


def test_writer_holds_the_lock_until_the_rename(tmp_path, monkeypatch):
    """While ``atomic_save`` writes, a cleanup (by another process, or this one) cannot take the temporary file."""
    seen = []

    def save_and_clean(obj, f, *args, **kwargs):
        seen.extend(remove_stale_temporary_files(tmp_path))
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        return original(obj, f, *args, **kwargs)

    original = torch.save
    monkeypatch.setattr(torch, "save", save_and_clean)
    atomic_save({"a": 1}, tmp_path / "model.ckpt")
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].startswith("model.ckpt."), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_resume_removes_debris(tmp_path):
    atomic_save({"a": 1}, tmp_path / "last.ckpt")
    stale = _debris(tmp_path, "last.ckpt.89abcdef.tmp")
    assert TorchCheckpointIO().load_checkpoint(tmp_path / "last.ckpt") == {"a": 1}
    assert not stale.exists()

