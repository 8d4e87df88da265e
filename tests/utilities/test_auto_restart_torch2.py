"""Fault-tolerant training (``PL_FAULT_TOLERANT_TRAINING=1``) on torch 2 (``compat/torch2-fault-tolerant-sampler``):
``FastForwardSampler`` is built without the ``data_source`` argument that ``Sampler.__init__`` no longer takes, and
its iteration survives torch's ``BatchSampler`` calling ``iter`` on it for every batch."""
from itertools import islice
from typing import List, Optional

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import seed_everything, Trainer
from pytorch_lightning.utilities.auto_restart import FastForwardSampler
from tests.helpers import BoringModel


@pytest.mark.parametrize("drop_last", [False, True])
def test_fast_forward_sampler_under_batch_sampler(drop_last):
    sampler = FastForwardSampler(SequentialSampler(range(7)))
    expected = [[0, 1], [2, 3], [4, 5]] + ([] if drop_last else [[6]])
    # bounded: a sampler that restarts for every batch would yield [0, 1] forever
    assert list(islice(BatchSampler(sampler, 2, drop_last), 10)) == expected
    # a new iteration starts from the beginning again
    expected = [[0, 1, 2], [3, 4, 5]] + ([] if drop_last else [[6]])
    assert list(islice(BatchSampler(sampler, 3, drop_last), 10)) == expected


class RowModel(BoringModel):
    """Trains on rows whose values are their index, records which rows each step saw, and can fail at a step."""

    def __init__(self, fail_at_step: Optional[int] = None) -> None:
        super().__init__()
        self.fail_at_step = fail_at_step
        self.seen: List[List[int]] = []

    def train_dataloader(self):
        rows = torch.arange(16, dtype=torch.float32).view(-1, 1).repeat(1, 32)
        return DataLoader(rows, batch_size=2)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError("injected failure")
        self.seen.append(batch[:, 0].int().tolist())
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def _trainer(tmp_path):
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_epochs=1, limit_train_batches=6, limit_val_batches=0))


def test_fault_tolerant_fit_and_mid_epoch_restore(tmp_path, monkeypatch):
    """A fit with fault-tolerant training sees every batch once, and after a failure mid-epoch resumes from the
    auto-saved checkpoint at the batch where it failed."""
    monkeypatch.setenv("PL_FAULT_TOLERANT_TRAINING", "1")
    seed_everything(1)
    model = RowModel()
    _trainer(tmp_path).fit(model)
    assert model.seen == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]

    seed_everything(1)
    with pytest.raises(RuntimeError, match="injected failure"):
        _trainer(tmp_path).fit(RowModel(fail_at_step=3))
    checkpoint = tmp_path / ".pl_auto_save.ckpt"
    assert checkpoint.exists()

    seed_everything(1)
    resumed = RowModel()
    trainer = _trainer(tmp_path)
    trainer.fit(resumed, ckpt_path=str(checkpoint))
    assert resumed.seen == model.seen[3:]
    assert trainer.global_step == 6
