"""Trainer-level round trips through the streaming save and the memory-mapped load (patches 0005 and 0006)."""
import copy
import inspect

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from pytorch_lightning import Callback, Trainer
from pytorch_lightning.utilities.cloud_io import load as pl_load
from tests.helpers.boring_model import BoringModel
from tests.helpers.scenario import quiet_trainer_kwargs


class AdamModel(BoringModel):
    """Adam keeps tensors in the optimizer state, so a resume has optimizer tensors to restore."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.layer.parameters(), lr=0.01)


def _trainer(tmp_path, **kwargs):
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, **{"max_steps": 3, "limit_val_batches": 0, **kwargs}))


def _assert_state_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        elif isinstance(value, dict):
            _assert_state_equal(actual[key], value)
        elif isinstance(value, (list, tuple)):
            assert len(actual[key]) == len(value)
            for a, e in zip(actual[key], value):
                _assert_state_equal({"x": a}, {"x": e})
        else:
            assert actual[key] == value, key


@pytest.mark.parametrize("remote", [False, True])
def test_weights_only_checkpoint_round_trip(tmp_path, remote):
    model = AdamModel()
    trainer = _trainer(tmp_path)
    trainer.fit(model)
    path = "memory://round-trip-tests/weights.ckpt" if remote else str(tmp_path / "weights.ckpt")
    try:
        trainer.save_checkpoint(path, weights_only=True)
        checkpoint = pl_load(path)
        assert "optimizer_states" not in checkpoint and "state_dict" in checkpoint
        _assert_state_equal(checkpoint["state_dict"], model.state_dict())
        restored = AdamModel.load_from_checkpoint(path)
        _assert_state_equal(restored.state_dict(), model.state_dict())
    finally:
        if remote:
            MemoryFileSystem().rm("/round-trip-tests", recursive=True)


class _RecordOnTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.state_dict = copy.deepcopy(pl_module.state_dict())
        self.optimizer_state = copy.deepcopy(trainer.optimizers[0].state_dict())


def test_resume_restores_exactly_through_mmap(tmp_path, monkeypatch):
    model = AdamModel()
    trainer = _trainer(tmp_path)
    trainer.fit(model)
    path = tmp_path / "full.ckpt"
    trainer.save_checkpoint(path)
    expected_model = copy.deepcopy(model.state_dict())
    expected_optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
    assert expected_optimizer["state"], "Adam should have state to restore"

    calls = []
    real_load = torch.load

    def spy(f, *args, **kwargs):
        calls.append(kwargs)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    record = _RecordOnTrainStart()
    resumed = AdamModel()
    trainer = _trainer(tmp_path, max_steps=5, callbacks=[record])
    trainer.fit(resumed, ckpt_path=str(path))

    if "mmap" in inspect.signature(real_load).parameters:
        assert [c.get("mmap") for c in calls] == [True]
    _assert_state_equal(record.state_dict, expected_model)
    _assert_state_equal(record.optimizer_state, expected_optimizer)
    assert trainer.global_step == 5
