"""Tests for memory-mapped checkpoint loading (the fork/mmap-checkpoint-load patch)."""
import inspect
import mmap
import sys

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
from pytorch_lightning.utilities import mmap_load
from pytorch_lightning.utilities.cloud_io import atomic_save
from pytorch_lightning.utilities.cloud_io import load as pl_load
from tests.helpers.mmap_check import is_mapped_from

_TORCH_LOAD_MMAP = "mmap" in inspect.signature(torch.load).parameters
_requires_mmap = pytest.mark.skipif(not _TORCH_LOAD_MMAP, reason="torch.load(mmap=True) needs torch>=2.1")
_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _checkpoint():
    generator = torch.Generator().manual_seed(0)
    return {
        "state_dict": {"layer.weight": torch.randn(64, 32, generator=generator), "layer.bias": torch.zeros(64)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(64, 32, generator=generator)}}, "param_groups": []}],
        "epoch": 3,
        "hyper_parameters": {"lr": 0.1},
    }


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{i}")


def _assert_equal(actual, expected):
    actual_tensors, expected_tensors = dict(_tensors(actual)), dict(_tensors(expected))
    assert actual_tensors.keys() == expected_tensors.keys()
    for key, tensor in expected_tensors.items():
        assert actual_tensors[key].dtype == tensor.dtype and torch.equal(actual_tensors[key], tensor), key
    assert actual["epoch"] == expected["epoch"] and actual["hyper_parameters"] == expected["hyper_parameters"]


@pytest.fixture
def load_calls(monkeypatch):
    """Record the arguments of every ``torch.load`` call."""
    calls = []
    real_load = torch.load

    def spy(f, *args, **kwargs):
        calls.append((f, kwargs))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


@_requires_mmap
@_linux
def test_load_mmap_local_zip_file(tmp_path, load_calls):
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    loaded = pl_load(path, mmap=True)
    _assert_equal(loaded, _checkpoint())
    [(f, kwargs)] = load_calls
    # by default without running code from the file (fork/safe-checkpoint-load)
    assert f == str(path) and kwargs["mmap"] is True and kwargs.get("weights_only") is True
    for key, tensor in _tensors(loaded):
        assert is_mapped_from(tensor, path), key


@_requires_mmap
@_linux
def test_load_mmap_file_uri(tmp_path, load_calls):
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    loaded = pl_load(f"file://{path}", mmap=True)
    _assert_equal(loaded, _checkpoint())
    assert load_calls[0][1]["mmap"] is True
    assert is_mapped_from(loaded["state_dict"]["layer.weight"], path)


@_linux
def test_load_without_mmap_reads_into_memory(tmp_path, load_calls):
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    loaded = pl_load(path)
    _assert_equal(loaded, _checkpoint())
    assert "mmap" not in load_calls[0][1]
    assert not is_mapped_from(loaded["state_dict"]["layer.weight"], path)


@_linux
def test_load_mmap_legacy_format_falls_back(tmp_path, load_calls):
    path = tmp_path / "legacy.ckpt"
    torch.save(_checkpoint(), path, _use_new_zipfile_serialization=False)
    loaded = pl_load(path, mmap=True)
    _assert_equal(loaded, _checkpoint())
    [(f, kwargs)] = load_calls
    assert "mmap" not in kwargs and not isinstance(f, str)
    assert not is_mapped_from(loaded["state_dict"]["layer.weight"], path)


def test_load_mmap_file_object_falls_back(tmp_path, load_calls):
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    with open(path, "rb") as f:
        loaded = pl_load(f, mmap=True)
    _assert_equal(loaded, _checkpoint())
    assert "mmap" not in load_calls[0][1]


def test_load_mmap_remote_path_falls_back(load_calls):
    path = "memory://mmap-load-tests/model.ckpt"
    try:
        atomic_save(_checkpoint(), path)
        _assert_equal(TorchCheckpointIO().load_checkpoint(path), _checkpoint())
        assert "mmap" not in load_calls[0][1]
    finally:
        MemoryFileSystem().rm("/mmap-load-tests", recursive=True)


def test_load_mmap_unsupported_torch_falls_back(tmp_path, load_calls, monkeypatch):
    monkeypatch.setattr(mmap_load, "_TORCH_LOAD_MMAP_AVAILABLE", False)
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    _assert_equal(pl_load(path, mmap=True), _checkpoint())
    assert "mmap" not in load_calls[0][1]


@_requires_mmap
@pytest.mark.skipif(not hasattr(mmap, "MAP_SHARED"), reason="POSIX mmap flags")
def test_load_mmap_not_with_shared_mappings(tmp_path, load_calls, monkeypatch):
    """With a global ``MAP_SHARED`` setting, writes to loaded tensors would change the file: no mmap then."""
    monkeypatch.setattr(torch.serialization, "get_default_mmap_options", lambda: mmap.MAP_SHARED)
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    _assert_equal(pl_load(path, mmap=True), _checkpoint())
    assert "mmap" not in load_calls[0][1]


@_requires_mmap
def test_load_mmap_writes_stay_private(tmp_path):
    """In-place updates of mapped tensors (an optimizer step on restored state) never modify the checkpoint."""
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    before = path.read_bytes()
    loaded = pl_load(path, mmap=True)
    for _, tensor in _tensors(loaded):
        tensor.add_(1)
    assert path.read_bytes() == before
    _assert_equal(pl_load(path, mmap=True), _checkpoint())


@_requires_mmap
@_linux
def test_load_mmap_survives_replacing_the_checkpoint(tmp_path):
    """Saving a new checkpoint over the loaded one (``os.replace``) leaves the mapped tensors intact."""
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    loaded = pl_load(path, mmap=True)
    other = _checkpoint()
    other["state_dict"] = {k: torch.full_like(v, 7.0) for k, v in _checkpoint()["state_dict"].items()}
    atomic_save(other, path)
    _assert_equal(loaded, _checkpoint())
    assert torch.equal(pl_load(path)["state_dict"]["layer.bias"], torch.full((64,), 7.0))


@_requires_mmap
def test_torch_checkpoint_io_loads_with_mmap(tmp_path, load_calls):
    path = tmp_path / "model.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(), path)
    _assert_equal(TorchCheckpointIO().load_checkpoint(path), _checkpoint())
    assert load_calls[0][1]["mmap"] is True
    with pytest.raises(FileNotFoundError):
        TorchCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_load_mmap_not_on_windows(tmp_path, load_calls, monkeypatch):
    """Windows cannot replace a mapped file, so the next save over the resumed checkpoint would fail."""
    path = tmp_path / "model.ckpt"
    atomic_save(_checkpoint(), path)
    monkeypatch.setattr(mmap_load.os, "name", "nt")
    loaded = pl_load(path, mmap=True)
    monkeypatch.undo()
    _assert_equal(loaded, _checkpoint())
    assert "mmap" not in load_calls[0][1]
