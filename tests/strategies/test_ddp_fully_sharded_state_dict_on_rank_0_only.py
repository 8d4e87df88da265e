"""``DDPFullyShardedStrategy(state_dict_on_rank_0_only=...)``: only global rank 0 holds and writes the full state
dict (#11207). This file imports only helpers that upstream's test suite has, so it ports unchanged."""
import contextlib
import os
from unittest import mock

import pytest
import torch

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies import DDPFullyShardedStrategy, StrategyRegistry
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from tests.helpers import BoringModel
from tests.helpers.runif import RunIf

if torch.distributed.is_available():
    from fairscale.nn import auto_wrap, wrap
    from fairscale.nn.data_parallel import FullyShardedDataParallel
    from fairscale.nn.wrap.auto_wrap import ConfigAutoWrap


@pytest.fixture(autouse=True)
def _restore_rank_zero_only():
    # ``LightningEnvironment.set_global_rank`` sets the process-wide ``rank_zero_only.rank``: a test of rank 1 must
    # not silence the ``rank_zero_*`` calls of the tests that run after it in the same process
    rank = rank_zero_only.rank
    yield
    rank_zero_only.rank = rank


def _strategy_on_rank(global_rank: int, **kwargs) -> DDPFullyShardedStrategy:
    environment = LightningEnvironment()
    environment.set_world_size(2)
    environment.set_global_rank(global_rank)
    return DDPFullyShardedStrategy(cluster_environment=environment, **kwargs)


@RunIf(fairscale_fully_sharded=True)
def test_state_dict_on_rank_0_only_default():
    assert DDPFullyShardedStrategy().state_dict_on_rank_0_only is True
    assert DDPFullyShardedStrategy(state_dict_on_rank_0_only=False).state_dict_on_rank_0_only is False


@RunIf(fairscale_fully_sharded=True)
@pytest.mark.parametrize("name", ["fsdp", "ddp_fully_sharded"])
def test_state_dict_on_rank_0_only_registry_default(name):
    assert StrategyRegistry.get(name).state_dict_on_rank_0_only is True
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2)
    assert isinstance(trainer.strategy, DDPFullyShardedStrategy)
    assert trainer.strategy.state_dict_on_rank_0_only is True


@RunIf(fairscale_fully_sharded=True)
@pytest.mark.parametrize("value", [None, 1, "True"])
def test_state_dict_on_rank_0_only_not_bool(value):
    with pytest.raises(MisconfigurationException, match="must be a bool"):
        DDPFullyShardedStrategy(state_dict_on_rank_0_only=value)


@RunIf(fairscale_fully_sharded=True)
@mock.patch("pytorch_lightning.strategies.fully_sharded._FAIRSCALE_FULLY_SHARDED_RANK_0_STATE_DICT_AVAILABLE", False)
def test_state_dict_on_rank_0_only_requires_fairscale_0_4_5():
    with pytest.raises(MisconfigurationException, match=r"requires `fairscale>=0.4.5`"):
        DDPFullyShardedStrategy()
    # with the flag off, an older fairscale keeps working and never sees the new argument
    strategy = DDPFullyShardedStrategy(state_dict_on_rank_0_only=False)
    with mock.patch.object(DDPFullyShardedStrategy, "process_group", None), strategy.model_sharded_context():
        assert "state_dict_on_rank_0_only" not in ConfigAutoWrap.kwargs


@RunIf(fairscale_fully_sharded=True)
@pytest.mark.parametrize("flag", [True, False])
def test_state_dict_on_rank_0_only_reaches_fsdp(flag):
    strategy = DDPFullyShardedStrategy(state_dict_on_rank_0_only=flag)
    with mock.patch.object(DDPFullyShardedStrategy, "process_group", None), strategy.model_sharded_context():
        assert ConfigAutoWrap.kwargs.get("state_dict_on_rank_0_only", False) is flag
        assert ConfigAutoWrap.kwargs["state_dict_device"] == torch.device("cpu")


@RunIf(fairscale_fully_sharded=True)
def test_state_dict_on_rank_0_only_needs_global_rank_0_in_process_group():
    strategy = DDPFullyShardedStrategy()
    with mock.patch.object(DDPFullyShardedStrategy, "process_group", "group"), mock.patch(
        "torch.distributed.is_initialized", return_value=True
    ), mock.patch("torch.distributed.get_process_group_ranks", return_value=[1, 2], create=True):
        with pytest.raises(MisconfigurationException, match="global rank 0 is not a member"):
            with strategy.model_sharded_context():
                pass
    # the flag off does not care which ranks the group has
    strategy = DDPFullyShardedStrategy(state_dict_on_rank_0_only=False)
    with mock.patch.object(DDPFullyShardedStrategy, "process_group", "group"), mock.patch(
        "torch.distributed.is_initialized", return_value=True
    ), mock.patch("torch.distributed.get_process_group_ranks", return_value=[1, 2], create=True):
        with strategy.model_sharded_context():
            pass


@RunIf(fairscale_fully_sharded=True)
@pytest.mark.parametrize("global_rank, expected_calls", [(0, 1), (1, 0)])
def test_only_global_rank_0_saves(tmp_path, global_rank, expected_calls):
    strategy = _strategy_on_rank(global_rank)
    strategy._checkpoint_io = mock.Mock()
    strategy.save_checkpoint({"state_dict": {}}, tmp_path / "model.ckpt")
    assert strategy.checkpoint_io.save_checkpoint.call_count == expected_calls


@RunIf(fairscale_fully_sharded=True)
@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("global_rank", [0, 1])
def test_lightning_module_state_dict_per_rank(global_rank, flag):
    strategy = _strategy_on_rank(global_rank, state_dict_on_rank_0_only=flag)
    model = BoringModel()
    with mock.patch.object(DDPFullyShardedStrategy, "lightning_module", model):
        state_dict = strategy.lightning_module_state_dict()
    if flag and global_rank != 0:
        assert state_dict == {}
    else:
        assert set(state_dict) == {"layer.weight", "layer.bias"}


class ShardedBoringModel(BoringModel):
    """A plain parameter on each side of an FSDP stack of two blocks and a head.

    By default the layers are created in ``configure_sharded_model``; with ``layers_in_init=True`` they are created
    in ``__init__`` and only wrapped in ``configure_sharded_model``, so that a checkpoint can be restored into the
    unsharded layers before they are sharded.
    """

    def __init__(self, wrapping: str = "wrap", layers_in_init: bool = False):
        super().__init__()
        self.wrapping = wrapping
        self.sharded = False
        self.before = torch.nn.Parameter(torch.zeros(32))
        self.layer = self._layers() if layers_in_init else None
        if layers_in_init:
            self.after = torch.nn.Parameter(torch.ones(2))

    @staticmethod
    def _layers() -> torch.nn.Module:
        blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(2)]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(32, 2))

    def configure_sharded_model(self) -> None:
        if self.sharded:
            return
        if self.layer is None:
            self.layer = self._layers()
            self.after = torch.nn.Parameter(torch.ones(2))
        if self.wrapping == "wrap":
            self.layer = wrap(torch.nn.Sequential(*[wrap(block) for block in self.layer[:2]], self.layer[2]))
        else:
            # the head is too small for the policy, so each block is an outermost FSDP instance of its own
            self.layer = auto_wrap(self.layer)
        self.sharded = True

    def forward(self, x):
        return self.layer(x + self.before) * self.after

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _outermost_fsdp_instances(model: torch.nn.Module) -> list:
    instances = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    nested = {id(inner) for m in instances for inner in m.modules() if inner is not m}
    return [m for m in instances if id(m) not in nested]


def _gathered_state(model: torch.nn.Module) -> dict:
    """Every rank's copy of the full parameters, keyed like the state dict (collective). Every outermost FSDP
    instance is summoned: ``auto_wrap`` leaves one per block."""
    with contextlib.ExitStack() as stack:
        for instance in _outermost_fsdp_instances(model):
            stack.enter_context(instance.summon_full_params(recurse=True))
        return {
            k.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", ""): p.detach().cpu().clone()
            for k, p in model.named_parameters()
        }


def _assert_same_tensors(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[key].cpu(), tensor), key


def run_fully_sharded_state_dict_on_rank_0_only(
    tmpdir, wrapping: str, accelerator: str = "gpu", strategy_cls=DDPFullyShardedStrategy, save_weights_only=False
) -> dict:
    """Fit on 2 devices, save with ``state_dict_on_rank_0_only=True``, check what every rank holds and wrote, then
    restore the checkpoint with ``trainer.test(ckpt_path=...)``. Runs on every rank; returns what it checked.

    ``strategy_cls`` builds the strategy (``DDPFullyShardedStrategy`` or a subclass); ``save_weights_only`` applies to
    ``ModelCheckpoint`` and ``trainer.save_checkpoint``.
    """
    trainer_kwargs = dict(
        default_root_dir=tmpdir,
        accelerator=accelerator,
        devices=2,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        limit_test_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = ShardedBoringModel(wrapping)
    trainer = Trainer(
        strategy=strategy_cls(min_num_params=100, state_dict_on_rank_0_only=True),
        callbacks=[ModelCheckpoint(save_weights_only=save_weights_only)],
        **trainer_kwargs,
    )
    # pin the instance: without a user's CheckpointIO, the property returns a new default one on every access
    checkpoint_io = trainer.strategy.checkpoint_io = trainer.strategy.checkpoint_io
    with mock.patch.object(checkpoint_io, "save_checkpoint", wraps=checkpoint_io.save_checkpoint) as save:
        trainer.fit(model)
        path = os.path.join(trainer.strategy.broadcast(str(tmpdir)), "model.ckpt")
        trainer.save_checkpoint(path, weights_only=save_weights_only)
    written = [str(call.args[1]) for call in save.call_args_list]

    state_dict = trainer.strategy.lightning_module_state_dict()  # collective
    full = _gathered_state(model)  # collective
    assert len(_outermost_fsdp_instances(model)) == (1 if wrapping == "wrap" else 2)
    assert all(m.state_dict_on_rank_0_only for m in model.modules() if isinstance(m, FullyShardedDataParallel))
    assert {"before", "after"} < set(full)
    if trainer.global_rank == 0:
        _assert_same_tensors(state_dict, full)
        # ModelCheckpoint's file and ours: both hold the full parameters of every outermost FSDP instance
        assert len(written) == 2 and written[-1] == path, (written, path)
        for file in written:
            _assert_same_tensors(pl_load(file, map_location="cpu")["state_dict"], full)
        # and load strictly into the unsharded model (``wrap`` outside ``enable_wrap`` returns the module as is)
        plain = ShardedBoringModel(wrapping)
        plain.configure_sharded_model()
        plain.load_state_dict(pl_load(path, map_location="cpu")["state_dict"], strict=True)
    else:
        assert state_dict == {}
        assert written == []
    trainer.strategy.barrier()

    # restore into a fresh model whose layers exist before they are sharded, as 1.6.5 loads the state dict into the
    # LightningModule before ``configure_sharded_model``
    saved = pl_load(path, map_location="cpu")["state_dict"]
    fresh = ShardedBoringModel(wrapping, layers_in_init=True)
    assert not torch.equal(fresh.before, saved["before"])
    trainer = Trainer(
        strategy=strategy_cls(min_num_params=100, state_dict_on_rank_0_only=True),
        enable_checkpointing=False,
        **trainer_kwargs,
    )
    trainer.test(fresh, ckpt_path=path)
    restored = _gathered_state(fresh)  # collective
    _assert_same_tensors(restored, saved)
    return {
        "rank": trainer.global_rank,
        "state_dict_keys": len(state_dict),
        "written": len(written),
        "restored_keys": sorted(restored),
    }


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.parametrize("wrapping", ["wrap", "auto_wrap"])
def test_fully_sharded_state_dict_on_rank_0_only_multi_gpu(tmpdir, wrapping):
    run_fully_sharded_state_dict_on_rank_0_only(tmpdir, wrapping, accelerator="gpu")
