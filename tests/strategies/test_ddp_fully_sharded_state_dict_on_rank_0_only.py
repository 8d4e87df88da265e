"""``DDPFullyShardedStrategy(state_dict_on_rank_0_only=...)``: only global rank 0 holds and writes the full state
dict (#11207). This file imports only helpers that upstream's test suite has, so it ports unchanged."""
import os
from unittest import mock

import pytest
import torch

from pytorch_lightning import Trainer
from pytorch_lightning.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies import DDPFullyShardedStrategy, StrategyRegistry
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from tests.helpers import BoringModel
from tests.helpers.runif import RunIf

if torch.distributed.is_available():
    from fairscale.nn import auto_wrap, wrap
    from fairscale.nn.data_parallel import FullyShardedDataParallel
    from fairscale.nn.wrap.auto_wrap import ConfigAutoWrap


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
    """Layers created in ``configure_sharded_model``, with a plain parameter on each side of the FSDP stack."""

    def __init__(self, wrapping: str = "wrap"):
        super().__init__()
        self.wrapping = wrapping
        self.layer = None
        self.before = torch.nn.Parameter(torch.zeros(32))

    def configure_sharded_model(self) -> None:
        if self.layer is not None:
            return
        blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(2)]
        if self.wrapping == "wrap":
            self.layer = wrap(torch.nn.Sequential(*[wrap(b) for b in blocks], torch.nn.Linear(32, 2)))
        else:
            self.layer = auto_wrap(torch.nn.Sequential(*blocks, torch.nn.Linear(32, 2)))
        self.after = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.layer(x + self.before) * self.after

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _gathered_state(model: torch.nn.Module) -> dict:
    roots = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m._is_root]
    with roots[0].summon_full_params(recurse=True):
        return {
            k.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", ""): p.detach().cpu().clone()
            for k, p in model.named_parameters()
        }


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.parametrize("wrapping", ["wrap", "auto_wrap"])
def test_fully_sharded_state_dict_on_rank_0_only_multi_gpu(tmpdir, wrapping):
    model = ShardedBoringModel(wrapping)
    strategy = DDPFullyShardedStrategy(min_num_params=100)
    trainer = Trainer(
        default_root_dir=tmpdir, accelerator="gpu", devices=2, strategy=strategy, max_epochs=1, limit_val_batches=2
    )
    trainer.fit(model)
    path = os.path.join(trainer.strategy.broadcast(str(tmpdir)), "model.ckpt")
    trainer.save_checkpoint(path)

    state_dict = trainer.strategy.lightning_module_state_dict()  # collective
    full = _gathered_state(model)  # collective
    if trainer.global_rank != 0:
        assert state_dict == {}
    else:
        saved = torch.load(path, map_location="cpu")["state_dict"]
        assert set(saved) == set(full)
        for key, tensor in full.items():
            assert torch.equal(saved[key].cpu(), tensor), key
    trainer.strategy.barrier()

    # reload into a fresh trainer
    strategy = DDPFullyShardedStrategy(min_num_params=100)
    trainer = Trainer(default_root_dir=tmpdir, accelerator="gpu", devices=2, strategy=strategy, max_epochs=1)
    trainer.test(model, ckpt_path=path)
