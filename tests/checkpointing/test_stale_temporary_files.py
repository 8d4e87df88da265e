"""Temporary files of checkpoint saves that were killed mid-write are removed by the next save into the directory and
by every load from it; files that are not such debris, and saves that may still be in flight, here or on another
host, are left alone. Also where ``flock`` fails as on NFS and Lustre (see ``tests/helpers/flock_faults.py``): no
save depends on a file lock."""
import multiprocessing
import os
import signal
import subprocess
import time

import pytest
import torch

from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.atomic_save import remove_stale_temporary_files
from pytorch_lightning.utilities.cloud_io import atomic_save
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile, _streamed_save_available
from tests.helpers import flock_faults
from tests.helpers.checkpoint_debris import OTHER_HOST, dead_pid, debris, local_temporary_name

TWO_DAYS = 2 * 24 * 3600


@pytest.fixture(params=flock_faults.KINDS)
def flock_fails(request):
    """``flock`` in this process fails as on NFSv3 without lockd, Lustre without ``flock``, or behaves as NFS's
    byte-range emulation of it."""
    flock_faults.install(request.param)
    yield request.param
    flock_faults.install(None)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_next_save_removes_debris_of_killed_saves(tmp_path):
    dead = dead_pid()
    stale = [
        debris(tmp_path, local_temporary_name("model.ckpt", dead)),
        debris(tmp_path, local_temporary_name("other.ckpt", dead, "deadbeef")),
        debris(tmp_path, local_temporary_name("empty.ckpt", dead, "00000000"), data=b""),
        # written elsewhere, or by an earlier revision of the fork, and untouched for two days
        debris(tmp_path, f"model.ckpt.{OTHER_HOST}.4242.89abcdef.tmp", age=TWO_DAYS),
        debris(tmp_path, "model.ckpt.0123abcd.tmp", age=TWO_DAYS),
    ]
    atomic_save({"a": torch.ones(2)}, tmp_path / "model.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"], stale


def test_cleanup_keeps_files_that_are_not_debris(tmp_path):
    dead, old = dead_pid(), time.time() - TWO_DAYS
    keep = {
        "notes.tmp": b"PK\x03\x04",  # not our name
        "model.ckpt.tmp": b"PK\x03\x04",
        "model.ckpt.0123abcg.tmp": b"PK\x03\x04",  # not 8 hex digits
        "model.ckpt.0123abcd.tmp.bak": b"PK\x03\x04",
        "model.ckpt.0123ABCD.tmp": b"PK\x03\x04",
        "data.12345678.tmp": b"user data",  # our names, but not written by torch.save
        local_temporary_name("data", dead): b"user data",
    }
    for name, data in keep.items():
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (old, old))
    (tmp_path / local_temporary_name("dir.ckpt", dead)).mkdir()
    target = tmp_path / "elsewhere.ckpt"
    target.write_bytes(b"PK\x03\x04")
    (tmp_path / local_temporary_name("link.ckpt", dead)).symlink_to(target)
    assert remove_stale_temporary_files(tmp_path) == []
    assert {p.name for p in tmp_path.iterdir()} == set(keep) | {
        local_temporary_name("dir.ckpt", dead),
        "elsewhere.ckpt",
        local_temporary_name("link.ckpt", dead),
    }


def test_cleanup_keeps_a_save_in_flight(tmp_path):
    """A temporary file whose writer still runs on this host is not touched, however old; once the writer is gone
    (killed) it is debris."""
    writer = subprocess.Popen(["sleep", "60"])
    try:
        path = debris(tmp_path, local_temporary_name("model.ckpt", writer.pid), age=TWO_DAYS)
        atomic_save({"a": 1}, tmp_path / "model.ckpt")
        assert path.exists()
    finally:
        writer.kill()
        writer.wait()
    assert remove_stale_temporary_files(tmp_path) == [str(path)]


def test_cleanup_keeps_recent_files_of_other_hosts(tmp_path):
    """The writer of a file from another host (or PID namespace) cannot be looked up: its file is removed only once
    it has not been modified for a day."""
    recent = debris(tmp_path, f"model.ckpt.{OTHER_HOST}.4242.0123abcd.tmp", age=3600)
    legacy = debris(tmp_path, "model.ckpt.0123abcd.tmp", age=3600)
    assert remove_stale_temporary_files(tmp_path) == []
    for path in (recent, legacy):
        os.utime(path, (time.time() - 25 * 3600, time.time() - 25 * 3600))
    assert sorted(remove_stale_temporary_files(tmp_path)) == sorted([str(recent), str(legacy)])


def test_writer_is_safe_from_cleanups_until_the_rename(tmp_path, monkeypatch):
    """While ``atomic_save`` writes, a cleanup (by another process, or this one) cannot take the temporary file."""
    seen = []

    def save_and_clean(obj, f, *args, **kwargs):
        seen.extend(remove_stale_temporary_files(tmp_path))
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        return original(obj, f, *args, **kwargs)

    original = torch.save
    monkeypatch.setattr(torch, "save", save_and_clean)
    atomic_save({"a": 1}, tmp_path / "model.ckpt")
    assert len(seen) == 1 and len(seen[0]) == 1
    assert seen[0][0] == local_temporary_name("model.ckpt", os.getpid(), seen[0][0][-12:-4])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_temporary_name_of_a_long_file_name_fits(tmp_path):
    """A name as long as the filesystem allows can be saved to, as Lightning 1.6.5 could: the temporary file's name
    is shortened."""
    path = tmp_path / ("m" * 250 + ".ckpt")
    atomic_save({"a": 1}, path)
    assert torch.load(path) == {"a": 1}


def test_resume_removes_debris(tmp_path):
    atomic_save({"a": 1}, tmp_path / "last.ckpt")
    stale = debris(tmp_path, local_temporary_name("last.ckpt", dead_pid(), "89abcdef"))
    assert TorchCheckpointIO().load_checkpoint(tmp_path / "last.ckpt") == {"a": 1}
    assert not stale.exists()


def test_saves_work_where_flock_fails(tmp_path, flock_fails):
    """Both writers (``atomic_save``, used by the gathered save, and the streamed save's file) save and leave
    nothing behind, not even a descriptor."""
    descriptors = _open_descriptors()
    atomic_save({"a": torch.arange(3)}, tmp_path / "gathered.ckpt")
    assert torch.equal(torch.load(tmp_path / "gathered.ckpt")["a"], torch.arange(3))
    if _streamed_save_available():
        writer = _StreamedCheckpointFile(tmp_path / "streamed.ckpt")
        writer.write_skeleton({"a": torch.arange(3)}, [])
        writer.commit()
        assert torch.equal(torch.load(tmp_path / "streamed.ckpt")["a"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gathered.ckpt", "streamed.ckpt"][
        : 2 if _streamed_save_available() else 1
    ]
    assert _open_descriptors() == descriptors


def test_cleanup_where_flock_fails(tmp_path, flock_fails):
    """The cleanup decides by the writer's host, process and the file's age, never by a lock: it removes the debris
    of dead writers and keeps the files of live ones."""
    writer = subprocess.Popen(["sleep", "60"])
    try:
        dead = debris(tmp_path, local_temporary_name("model.ckpt", dead_pid()))
        old = debris(tmp_path, f"model.ckpt.{OTHER_HOST}.4242.0123abcd.tmp", age=TWO_DAYS)
        live = debris(tmp_path, local_temporary_name("model.ckpt", writer.pid))
        recent = debris(tmp_path, f"model.ckpt.{OTHER_HOST}.4242.89abcdef.tmp")
        assert sorted(remove_stale_temporary_files(tmp_path)) == sorted([str(dead), str(old)])
        assert live.exists() and recent.exists()
    finally:
        writer.kill()
        writer.wait()
    assert remove_stale_temporary_files(tmp_path) == [str(live)]


def _save_and_get_killed(kind: str, path: str, streamed: bool, checkpoint: dict) -> None:
    """In a forked child: save ``checkpoint`` with ``flock`` failing as on ``kind``, and be killed (``SIGKILL``) when
    the file is about to be made durable, after its data was written. The child computes nothing: an OpenMP kernel
    (``torch.ones`` of this size) hangs in a forked child once the parent has used OpenMP (libgomp is not fork-safe),
    as earlier tests in the same process do."""
    try:
        flock_faults.install(kind)
        kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        os.fsync = os.fdatasync = kill
        if streamed:
            writer = _StreamedCheckpointFile(path)
            writer.write_skeleton(checkpoint, [])
            writer.commit()
        else:
            atomic_save(checkpoint, path)
    finally:
        os._exit(1)  # not killed: the test fails on the exit code


@pytest.mark.parametrize("streamed", [False, True], ids=["gathered", "streamed"])
def test_killed_save_is_removed_by_the_next_one(tmp_path, flock_fails, streamed):
    """``kill -9`` in the middle of a save leaves its temporary file; the next save (here: a restarted process,
    where ``flock`` fails the same way) removes it and saves."""
    if streamed and not _streamed_save_available():
        pytest.skip("needs torch >= 2.5")
    path = tmp_path / "model.ckpt"
    child = multiprocessing.get_context("fork").Process(
        target=_save_and_get_killed, args=(flock_fails, str(path), streamed, {"state_dict": {"w": torch.ones(2**16)}})
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [local_temporary_name("model.ckpt", child.pid, left[0][-12:-4])], left
    atomic_save({"next": 1}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]
    assert torch.load(path) == {"next": 1}
