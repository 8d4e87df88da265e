"""Trainer-level round trips through the streaming save and the memory-mapped load (the fork/streaming-atomic-save and
fork/mmap-checkpoint-load patches)."""
import copy
import inspect

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.utilities.cloud_io import load as pl_load
from tests.helpers.optimizer_models import AdamModel
from tests.helpers.resume_check import RecordOnTrainStart, state_mismatches


def _trainer(tmp_path, **kwargs):
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, **{"max_steps": 3, "limit_val_batches": 0, **kwargs}))


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
        assert state_mismatches(checkpoint["state_dict"], model.state_dict()) == []
        restored = AdamModel.load_from_checkpoint(path)
        assert state_mismatches(restored.state_dict(), model.state_dict()) == []
    finally:
        if remote:
            MemoryFileSystem().rm("/round-trip-tests", recursive=True)


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
    record = RecordOnTrainStart()
    resumed = AdamModel()
    trainer = _trainer(tmp_path, max_steps=5, callbacks=[record])
    trainer.fit(resumed, ckpt_path=str(path))

    if "mmap" in inspect.signature(real_load).parameters:
        assert [c.get("mmap") for c in calls] == [True]
    assert state_mismatches(record.state_dict, expected_model) == []
    assert state_mismatches(record.optimizer_state, expected_optimizer) == []
    assert trainer.global_step == 5
