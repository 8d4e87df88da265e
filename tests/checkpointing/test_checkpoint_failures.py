"""Single-process checks of CheckpointError (the fork/checkpoint-errors-on-every-rank patch); the 2-rank fault
scenarios are in tests/strategies/test_ddp_fully_sharded_faults.py."""
import errno
import os
from unittest import mock

import pytest
import torch

from fsdp_harness.corrupt_checkpoint import KINDS, make_bad_checkpoint
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.trainer.connectors.checkpoint_connector import CheckpointConnector
from pytorch_lightning.utilities.exceptions import CheckpointError
from tests.helpers.optimizer_models import SGDModel


class FullDiskIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _trainer(tmp_path, **kwargs):
    defaults = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=0)
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, **{**defaults, **kwargs}))


def test_failed_save_raises_checkpoint_error_naming_the_path(tmp_path):
    trainer = _trainer(tmp_path, plugins=[FullDiskIO()])
    trainer.fit(SGDModel())
    path = tmp_path / "model.ckpt"
    with pytest.raises(CheckpointError, match="Saving the checkpoint to .*model.ckpt.* failed: OSError") as info:
        trainer.save_checkpoint(path)
    assert isinstance(info.value.__cause__, OSError)
    assert not path.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_checkpoint_on_resume_raises_checkpoint_error_naming_the_path(tmp_path, kind):
    good = tmp_path / "good.ckpt"
    trainer = _trainer(tmp_path)
    trainer.fit(SGDModel())
    trainer.save_checkpoint(good)
    bad = tmp_path / f"{kind}.ckpt"
    make_bad_checkpoint(kind, good, bad)
    model = SGDModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_epochs=2)
    with pytest.raises(CheckpointError, match=f"Loading the .*{kind}.ckpt.* failed"):
        trainer.fit(model, ckpt_path=str(bad))
    assert trainer.global_step == 0
    # no partial load either
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _connector(rank, failed_ranks, world_size=2):
    trainer = mock.Mock(world_size=world_size, global_rank=rank)
    trainer.strategy.root_device = torch.device("cpu")
    trainer.strategy.all_gather.side_effect = lambda t: torch.tensor([int(r in failed_ranks) for r in range(2)])
    messages = {0: "OSError: [Errno 28] No space left on device", 1: "ValueError: boom"}
    trainer.strategy.broadcast.side_effect = lambda obj, src: messages[src]
    return CheckpointConnector(trainer)


@mock.patch("pytorch_lightning.trainer.connectors.checkpoint_connector.distributed_available", return_value=True)
def test_failure_on_one_rank_raises_on_every_rank(_):
    # rank 1 did not fail, rank 0 did: rank 1 raises with rank 0's message
    with pytest.raises(CheckpointError, match="'x.ckpt' failed on global rank 0: OSError.*No space left") as info:
        connector = _connector(rank=1, failed_ranks=[0])
        connector._raise_on_all_ranks_if_any_failed(None, "Saving the checkpoint to 'x.ckpt'")
    assert info.value.__cause__ is None
    # the failing rank chains its own error
    error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointError, match="failed on global rank 0") as info:
        _connector(rank=0, failed_ranks=[0, 1])._raise_on_all_ranks_if_any_failed(error, "Saving")
    assert info.value.__cause__ is error
    assert "also failed on global ranks [1]" in str(info.value)
    # nobody failed: no error, and no broadcast
    connector = _connector(rank=1, failed_ranks=[])
    connector._raise_on_all_ranks_if_any_failed(None, "Saving")
    connector.trainer.strategy.broadcast.assert_not_called()


@pytest.mark.parametrize("strategy_name, collective", [("ddp", False), ("fsdp", True)])
@mock.patch("pytorch_lightning.trainer.connectors.checkpoint_connector.distributed_available", return_value=True)
def test_save_is_collective_only_where_saving_already_is(_, strategy_name, collective):
    """FSDP gathers the state on every rank, so the save ends with the failure-flag collective; plain DDP allows
    ``trainer.save_checkpoint`` on rank 0 alone, where that collective would hang."""
    from pytorch_lightning.strategies import DDPFullyShardedStrategy, DDPStrategy

    connector = _connector(rank=0, failed_ranks=[])
    strategy_cls = DDPFullyShardedStrategy if strategy_name == "fsdp" else DDPStrategy
    connector.trainer.strategy.__class__ = type("Spec", (strategy_cls,), {})
    connector.trainer.strategy.save_checkpoint = mock.Mock()
    with mock.patch.object(connector, "dump_checkpoint", return_value={}):
        connector.save_checkpoint("x.ckpt")
    assert connector.trainer.strategy.all_gather.called is collective
    # a failing write raises the CheckpointError either way
    connector.trainer.strategy.save_checkpoint.side_effect = OSError(errno.ENOSPC, "No space left on device")
    connector.trainer.strategy.all_gather.side_effect = lambda t: torch.tensor([1, 0])
    with mock.patch.object(connector, "dump_checkpoint", return_value={}), pytest.raises(CheckpointError, match="x.ckpt"):
        connector.save_checkpoint("x.ckpt")
