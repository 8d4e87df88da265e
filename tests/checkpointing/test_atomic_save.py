"""Tests for the streaming, atomic ``atomic_save`` (the fork/streaming-atomic-save patch)."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from fsdp_harness.multiprocess import ROOT
from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
from pytorch_lightning.utilities.cloud_io import atomic_save
from pytorch_lightning.utilities.cloud_io import load as pl_load
from tests.helpers.write_hook import hooked_fdopen


def _checkpoint(seed: int = 0, numel: int = 1000):
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"a": torch.randn(numel, generator=generator), "b": torch.arange(7)},
        "epoch": seed,
        "hyper_parameters": {"lr": 0.1, "name": "x"},
    }


def _assert_checkpoints_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_checkpoints_equal(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def _stray_files(directory: Path, name: str):
    return sorted(p.name for p in directory.iterdir() if p.name != name)


@pytest.mark.parametrize("as_path", [False, True])
def test_atomic_save_local_round_trip(tmp_path, as_path):
    path = tmp_path / "model.ckpt"
    checkpoint = _checkpoint()
    atomic_save(checkpoint, path if as_path else str(path))
    _assert_checkpoints_equal(pl_load(path), checkpoint)
    # overwriting an existing checkpoint works and leaves only the target behind
    atomic_save(_checkpoint(1), path)
    _assert_checkpoints_equal(pl_load(path), _checkpoint(1))
    assert _stray_files(tmp_path, "model.ckpt") == []


def test_atomic_save_file_uri_and_new_directory(tmp_path):
    """``TorchCheckpointIO`` creates the folder; ``file://`` URLs are local paths too."""
    path = tmp_path / "sub" / "dir" / "model.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(), f"file://{path}")
    _assert_checkpoints_equal(pl_load(path), _checkpoint())
    assert _stray_files(path.parent, "model.ckpt") == []


def test_atomic_save_permissions_like_open(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~umask)


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks need privileges on Windows")
def test_atomic_save_writes_through_symlink(tmp_path):
    real = tmp_path / "real.ckpt"
    link = tmp_path / "link.ckpt"
    atomic_save(_checkpoint(0), real)
    link.symlink_to(real)
    atomic_save(_checkpoint(1), link)
    assert link.is_symlink()
    _assert_checkpoints_equal(pl_load(real), _checkpoint(1))


def _partial_then_raise(exception):
    """A ``torch.save`` replacement that writes part of a checkpoint into the file, then raises."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        real_save(_checkpoint(5, numel=100_000), f)
        assert f.tell() > 0
        raise exception

    return save


@pytest.mark.parametrize("exception", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_atomic_save_exception_keeps_previous_checkpoint(tmp_path, monkeypatch, exception):
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(0), path)
    before = path.read_bytes()

    monkeypatch.setattr(torch, "save", _partial_then_raise(exception))
    with pytest.raises(type(exception)):
        atomic_save(_checkpoint(1), path)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert _stray_files(tmp_path, "model.ckpt") == []


def test_atomic_save_failing_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    """The real ``torch.save`` streams into a file whose writes fail after 64 KiB, as on a full disk."""
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(0), path)
    before = path.read_bytes()

    written = []

    def fill_up(data):
        if sum(written) + len(data) > 64 * 1024:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(data))

    monkeypatch.setattr(os, "fdopen", hooked_fdopen(fill_up))
    # torch's zip writer may report the failed write as a RuntimeError while closing the archive
    with pytest.raises((OSError, RuntimeError)):
        atomic_save(_checkpoint(1, numel=1_000_000), path)
    monkeypatch.undo()

    assert sum(written) > 0, "the failure should happen after part of the checkpoint was written"
    assert path.read_bytes() == before
    assert _stray_files(tmp_path, "model.ckpt") == []


def test_atomic_save_exception_without_previous_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", _partial_then_raise(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        atomic_save(_checkpoint(), tmp_path / "model.ckpt")
    assert list(tmp_path.iterdir()) == []


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from pytorch_lightning.utilities.cloud_io import atomic_save
    from tests.helpers.write_hook import hooked_fdopen

    # every write takes a while, so that the parent can kill this process in the middle of the file
    os.fdopen = hooked_fdopen(lambda data: time.sleep(0.05))
    checkpoint = {"state_dict": {f"w{i}": torch.full((256 * 1024,), float(i)) for i in range(200)}}
    atomic_save(checkpoint, sys.argv[1])
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
@pytest.mark.parametrize("previous", [True, False])
def test_atomic_save_sigkill_keeps_previous_checkpoint(tmp_path, previous):
    """``kill -9`` in the middle of writing a 200 MiB checkpoint never truncates or removes the target."""
    path = tmp_path / "model.ckpt"
    if previous:
        atomic_save(_checkpoint(0), path)
        before = path.read_bytes()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(path)], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        partial = []
        while time.monotonic() < deadline and proc.poll() is None:
            partial = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and p.stat().st_size > 1024 * 1024]
            if partial:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the writer exited early with {proc.returncode}"
        assert partial, "the writer did not start writing within 60 seconds"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    if previous:
        assert path.read_bytes() == before
        _assert_checkpoints_equal(pl_load(path), _checkpoint(0))
    else:
        assert not path.exists()
    # a killed writer cannot clean up: what it leaves is a separate, clearly named temporary file
    assert all(p.startswith("model.ckpt.") and p.endswith(".tmp") for p in _stray_files(tmp_path, "model.ckpt"))


@pytest.fixture
def memory_path(request):
    fs = MemoryFileSystem()
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)
    root = f"/atomic-save-tests/{name}"
    yield f"memory://{root}/model.ckpt"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_atomic_save_memory_round_trip(memory_path):
    checkpoint = _checkpoint()
    TorchCheckpointIO().save_checkpoint(checkpoint, memory_path)
    _assert_checkpoints_equal(TorchCheckpointIO().load_checkpoint(memory_path), checkpoint)
    _assert_checkpoints_equal(pl_load(memory_path), checkpoint)


def test_atomic_save_memory_streams(memory_path, monkeypatch):
    """Remote paths are written through ``fs.open``, not through an in-memory copy of the whole checkpoint."""
    targets = []
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        targets.append(type(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    atomic_save(_checkpoint(), memory_path)
    assert targets and all(t.__name__ == "MemoryFile" for t in targets)


@pytest.mark.parametrize("exception", [RuntimeError("network down"), KeyboardInterrupt()])
def test_atomic_save_memory_exception_keeps_previous_checkpoint(memory_path, monkeypatch, exception):
    atomic_save(_checkpoint(0), memory_path)
    with fsspec.open(memory_path, "rb") as f:
        before = f.read()

    monkeypatch.setattr(torch, "save", _partial_then_raise(exception))
    with pytest.raises(type(exception)):
        atomic_save(_checkpoint(1), memory_path)
    monkeypatch.undo()

    with fsspec.open(memory_path, "rb") as f:
        assert f.read() == before
    fs = MemoryFileSystem()
    assert not fs._intrans, "the transaction must end with the failed write"
    assert fs.ls(memory_path.rsplit("/", 1)[0].replace("memory://", ""), detail=False) == [
        memory_path.replace("memory://", "")
    ]


class _NoTransactionMemoryFileSystem(MemoryFileSystem):
    """A filesystem that can only write files directly, like one without deferred (transactional) writes."""

    protocol = "notransactionmemory"

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if not autocommit:
            raise NotImplementedError("no transactions")
        return super()._open(path, mode, block_size, autocommit, cache_options, **kwargs)


def test_atomic_save_falls_back_to_buffered_write(monkeypatch):
    fsspec.register_implementation("notransactionmemory", _NoTransactionMemoryFileSystem, clobber=True)
    path = "notransactionmemory://atomic-save-tests/fallback/model.ckpt"
    targets = []
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        targets.append(type(f).__name__)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    try:
        atomic_save(_checkpoint(), path)
        monkeypatch.undo()
        assert targets == ["BytesIO"]
        _assert_checkpoints_equal(pl_load(path), _checkpoint())
    finally:
        store = _NoTransactionMemoryFileSystem.store
        for key in [key for key in store if "atomic-save-tests/fallback" in key]:
            del store[key]


def test_atomic_save_inside_callers_transaction(memory_path):
    fs = MemoryFileSystem()
    with fs.transaction:
        atomic_save(_checkpoint(), memory_path)
        assert not fs.exists(memory_path), "published only when the caller's transaction commits"
    _assert_checkpoints_equal(pl_load(memory_path), _checkpoint())


def test_atomic_save_local_streams_into_temporary_file(tmp_path, monkeypatch):
    """Local paths are written by ``torch.save`` straight into a temporary file next to the target, not a buffer."""
    calls = []
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        calls.append((os.fstat(f.fileno()), sorted(p.name for p in tmp_path.iterdir())))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    atomic_save(_checkpoint(), tmp_path / "model.ckpt")
    monkeypatch.undo()
    assert len(calls) == 1
    stat, names = calls[0]
    assert len(names) == 1 and names[0].startswith("model.ckpt.") and names[0].endswith(".tmp"), names
    # the file torch.save wrote into is the one that now is the checkpoint
    assert os.path.samestat(stat, os.stat(tmp_path / "model.ckpt"))
    assert _stray_files(tmp_path, "model.ckpt") == []
