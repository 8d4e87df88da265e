"""Where DDP and a single device restore a ``ckpt_path``: after ``configure_sharded_model`` when only that hook creates
the checkpoint's layers (``fork/restore-after-configure-sharded-model``), before it otherwise, as in 1.6.5.

The DDP cases run on 2 CPU ranks in one launch (``ddp_runs``); the single-device ones in this process.
"""
from argparse import Namespace

import pytest

from fsdp_harness.runner import ScenarioBatch, selected_tests
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from tests.checkpointing.restore_order_scenarios import ShardedLayers, in_process, validate_from

SCENARIOS = "tests.checkpointing.restore_order_scenarios"
BATCH_TIMEOUT = 300
ORDER = {
    # 1.6.5's order: the restore (`on_load_checkpoint`) comes before `configure_sharded_model`
    "plain": ["setup", "on_load_checkpoint", "configure_sharded_model", "configure_optimizers"],
    # the restore after the hook, still before the optimizers exist (and before DDP wraps the model)
    "sharded": ["setup", "configure_sharded_model", "on_load_checkpoint", "configure_optimizers"],
}


@pytest.fixture(scope="module")
def ddp_runs(request, tmp_path_factory) -> ScenarioBatch:
    batch = ScenarioBatch(SCENARIOS, tmp_path_factory.mktemp("restore_order"), timeout=BATCH_TIMEOUT)
    selected = selected_tests(request)
    if "test_ddp_resume" in selected:
        for model in ORDER:
            batch.add(model, "resume", "--model", model)
    if "test_fsdp_checkpoint_weights_load_under_ddp_and_on_one_device" in selected:
        batch.add("fsdp", "fsdp_weights")
    return batch


def assert_exact_resume(record: dict, model: str) -> None:
    assert record["calls"] == ORDER[model]
    assert record["loads"] == 1  # the file is loaded once, also when the restore waits for the hook
    assert record["model_mismatches"] == [] and record["optimizer_mismatches"] == []
    assert record["optimizer_state_tensors"] > 0  # Adam's step, exp_avg and exp_avg_sq were restored
    # and the resumed fit ended exactly where the uninterrupted one did
    assert record["final_mismatches"] == []


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("model", sorted(ORDER))
def test_ddp_resume(ddp_runs, model):
    rank0, rank1 = ddp_runs.results(model)
    for record in (rank0, rank1):
        assert_exact_resume(record, model)
        assert record["global_step"] == 8  # 2 epochs of 4 batches per rank
    # one info line, on global rank 0, only where the order changed
    if model == "sharded":
        assert len(rank0["order_messages"]) == 1 and "'layer.0.0.weight'" in rank0["order_messages"][0]
    else:
        assert rank0["order_messages"] == []
    assert rank1["order_messages"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", sorted(ORDER))
def test_single_device_resume(tmp_path, model):
    record = in_process(tmp_path, model)
    assert_exact_resume(record, model)
    assert record["global_step"] == 16  # 2 epochs of 8 batches
    assert len(record["order_messages"]) == (1 if model == "sharded" else 0)


@pytest.mark.timeout(120)
def test_keys_missing_after_the_hook_raise_the_strict_load_error(tmp_path):
    """A checkpoint of 3 blocks into a model of 2: restored after the hook, only the third block is unexpected."""
    path = tmp_path / "three.ckpt"
    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=1, limit_val_batches=0))
    trainer.fit(ShardedLayers(units=3))
    trainer.save_checkpoint(path)

    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=2, limit_val_batches=0))
    with pytest.raises(RuntimeError, match="Unexpected key") as raised:
        trainer.fit(ShardedLayers(units=2), ckpt_path=str(path))
    message = str(raised.value)
    assert '"layer.2.0.weight", "layer.2.0.bias"' in message
    assert "layer.0.0.weight" not in message and "Missing key" not in message


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_fsdp_checkpoint_weights_load_under_ddp_and_on_one_device(ddp_runs, tmp_path):
    """The file the fork's FSDP wrote for a model built in ``configure_sharded_model``: its weights load into the
    same model under DDP (2 ranks) and on one device, restored after the hook."""
    validated = [*ddp_runs.results("fsdp"), validate_from(Namespace(out=tmp_path, devices=1),
                                                          ddp_runs.folder("fsdp") / "fsdp.ckpt")]
    for record in validated:
        assert record["calls"] == ["setup", "configure_sharded_model", "on_load_checkpoint"]
        assert record["model_mismatches"] == []
