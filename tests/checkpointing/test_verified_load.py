"""The check of a checkpoint's CRC-32s on load (the fork/verified-checkpoints patch) in a single process and with DDP
on 2 CPU ranks: a bit flipped in a record the load reads raises a ``CheckpointError`` naming the record before any
step; a record the load does not read (the optimizer state, when validating) is not checked; files that cannot be
checked load with an info line; ``PL_CHECKPOINT_VERIFY`` other than 0 or 1 is refused. The FSDP resumes are in
``tests/strategies/test_ddp_fully_sharded_verified_load.py``."""
import logging
import math
import re
import zipfile
from pathlib import Path

import pytest
import torch

from fsdp_harness.corrupt_checkpoint import (
    flip_bit,
    pickle_record,
    pickled_float_byte,
    record_byte,
    record_of_keys,
    zero_tensor_crcs,
    zip_records,
)
from fsdp_harness.runner import run_scenario
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException
from tests.checkpointing import verified_load_scenarios
from tests.helpers.boring_model import BoringModel
from tests.helpers.optimizer_models import AdamModel

SAVED_STEPS, RESUMED_STEPS = 2, 4
UNCHECKED = "is loaded without checking its CRC-32s"


class CountBatches(Callback):
    def __init__(self) -> None:
        self.train = self.validation = 0

    def on_train_batch_start(self, *args, **kwargs) -> None:
        self.train += 1

    def on_validation_batch_start(self, *args, **kwargs) -> None:
        self.validation += 1


def _trainer(tmp_path: Path, max_steps: int = SAVED_STEPS, **kwargs) -> Trainer:
    defaults = dict(max_steps=max_steps, limit_val_batches=1, num_sanity_val_steps=1)
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, **{**defaults, **kwargs}))


def _save(tmp_path: Path, model_class=BoringModel) -> Path:
    trainer = _trainer(tmp_path)
    trainer.fit(model_class())
    path = tmp_path / "good.ckpt"
    trainer.save_checkpoint(path)
    return path


def _flipped(good: Path, key: str, fraction: float = 0.5) -> "tuple[Path, str]":
    """A copy of ``good`` with one bit flipped in the record of the checkpoint key ``key``; and that record."""
    record = record_of_keys(good)[key]
    bad = good.with_name(f"flipped-{key}.ckpt")
    flip_bit(good, bad, record_byte(good, record, fraction))
    return bad, record


@pytest.fixture
def info_lines(caplog):
    """``caplog`` at the info level of the ``pytorch_lightning`` logger. Under pytest (whose handlers are on the root
    logger before Lightning is imported) that logger propagates to the root, where ``caplog`` listens; where Lightning
    was imported first, it does not propagate, and ``caplog``'s handler is added to it."""
    logger = logging.getLogger("pytorch_lightning")
    added = not logger.propagate
    if added:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pytorch_lightning"):
            yield caplog
    finally:
        if added:
            logger.removeHandler(caplog.handler)


def _unchecked(caplog) -> list:
    return [r.getMessage() for r in caplog.records if UNCHECKED in r.getMessage()]


def test_damaged_copies(tmp_path):
    """The test files are what the tests say: ``zipfile`` finds the flipped bit in the record ``record_byte`` picked
    (and nowhere else); a float of the pickle flipped by ``pickled_float_byte`` still loads, one unit in the last
    place away; ``zero_tensor_crcs`` leaves every tensor record's CRC-32 0 and the pickle's set."""
    good = _save(tmp_path)
    records = zip_records(good)
    with zipfile.ZipFile(good) as archive:
        assert archive.testzip() is None
        assert {info.filename: info.CRC for info in archive.infolist()} == {n: r.crc for n, r in records.items()}
    bad, record = _flipped(good, "state_dict.layer.weight")
    assert record == "archive/data/0" and records[record].size == 32 * 2 * 4
    with zipfile.ZipFile(bad) as archive:
        assert archive.testzip() == record
    pickled = tmp_path / "pickled.ckpt"
    flip_bit(good, pickled, pickled_float_byte(good))
    with zipfile.ZipFile(pickled) as archive:
        assert archive.testzip() == pickle_record(good).name
    lr = torch.load(good, weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"]
    flipped_lr = torch.load(pickled, weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"]
    assert flipped_lr in (math.nextafter(lr, 0), math.nextafter(lr, 1)), (lr, flipped_lr)
    previous = tmp_path / "previous.ckpt"
    zeroed = zero_tensor_crcs(good, previous)
    assert sorted(zeroed) == ["archive/data/0", "archive/data/1"]
    with zipfile.ZipFile(previous) as archive:
        crcs = {info.filename: info.CRC for info in archive.infolist()}
    assert [crcs[name] for name in zeroed] == [0, 0] and crcs["archive/data.pkl"] == records["archive/data.pkl"].crc


def test_flipped_bit_in_a_weight_raises_before_any_step(tmp_path, info_lines):
    """``fit(ckpt_path=...)`` from a file with one bit flipped in the record of ``layer.weight`` raises a
    ``CheckpointError`` that names the file, the record, its bytes and key, and says it is corrupt; no batch ran."""
    bad, record = _flipped(_save(tmp_path), "state_dict.layer.weight")
    count = CountBatches()
    trainer = _trainer(tmp_path, RESUMED_STEPS, callbacks=[count])
    with pytest.raises(CheckpointError) as info:
        trainer.fit(BoringModel(), ckpt_path=str(bad))
    message = str(info.value)
    assert f"The checkpoint {str(bad)!r} is corrupt: its record {record!r} (bytes " in message, message
    assert "'state_dict.layer.weight'" in message
    assert (count.train, count.validation) == (0, 0)
    assert trainer.global_step == SAVED_STEPS  # restored, and not one step further
    assert _unchecked(info_lines) == []


def test_flipped_optimizer_state_is_checked_only_where_it_is_read(tmp_path):
    """A bit flipped only in the record of Adam's ``exp_avg``: ``validate`` does not restore the optimizer, nor read
    or check that record, and runs; ``fit`` reads it and raises naming it."""
    bad, record = _flipped(_save(tmp_path, AdamModel), "optimizer_states.0.state.0.exp_avg")
    count = CountBatches()
    trainer = _trainer(tmp_path, RESUMED_STEPS, callbacks=[count])
    trainer.validate(AdamModel(), ckpt_path=str(bad), verbose=False)
    assert count.validation == 1
    count = CountBatches()
    trainer = _trainer(tmp_path, RESUMED_STEPS, callbacks=[count])
    with pytest.raises(CheckpointError, match=re.escape(f"is corrupt: its record {record!r} (bytes ")) as info:
        trainer.fit(AdamModel(), ckpt_path=str(bad))
    assert "'optimizer_states.0.state.0.exp_avg'" in str(info.value)
    assert (count.train, count.validation) == (0, 0)


def test_good_file_resumes_checked(tmp_path, info_lines):
    good = _save(tmp_path)
    trainer = _trainer(tmp_path, RESUMED_STEPS)
    trainer.fit(BoringModel(), ckpt_path=str(good))
    assert trainer.global_step == RESUMED_STEPS
    assert _unchecked(info_lines) == []


class EditingModel(BoringModel):
    """Adds 1 in place to the checkpoint's ``layer.weight`` in ``on_load_checkpoint``, as user code may."""

    def on_load_checkpoint(self, checkpoint) -> None:
        checkpoint["state_dict"]["layer.weight"].add_(1.0)


class WeightsAtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.weight = pl_module.layer.weight.detach().clone()


def test_weight_edited_in_place_on_load_is_not_called_corrupt(tmp_path, info_lines):
    """``on_load_checkpoint`` edits the memory-mapped weight in place (its pages become the process's own): the load
    reads the edited bytes, which do not match the record's CRC-32, reads the record again from the file, which does,
    and resumes with the edited weight; the same edit of a file with a bit flipped in that record still raises."""
    good = _save(tmp_path)
    saved = torch.load(good, weights_only=False)["state_dict"]["layer.weight"]
    start = WeightsAtStart()
    trainer = _trainer(tmp_path, RESUMED_STEPS, callbacks=[start])
    trainer.fit(EditingModel(), ckpt_path=str(good))
    assert trainer.global_step == RESUMED_STEPS
    torch.testing.assert_close(start.weight, saved + 1.0)
    assert _unchecked(info_lines) == []
    bad, record = _flipped(good, "state_dict.layer.weight")
    trainer = _trainer(tmp_path, RESUMED_STEPS)
    with pytest.raises(CheckpointError, match=re.escape(f"is corrupt: its record {record!r} (bytes ")):
        trainer.fit(EditingModel(), ckpt_path=str(bad))
    assert trainer.global_step == SAVED_STEPS


@pytest.mark.parametrize(
    "kind, why",
    [
        ("crc_off", "it was written with CRC-32 turned off (`torch.serialization.set_crc32_options(False)`)"),
        ("legacy", "it is not in torch's zip format (a legacy file)"),
    ],
)
def test_file_that_cannot_be_checked_loads_with_an_info_line(tmp_path, info_lines, kind, why):
    """A file ``torch.save`` wrote with CRC-32 off (every record's 0), and one in torch's legacy (non-zip) format,
    resume as before; the load says once, at info level, that it is not checked and why."""
    checkpoint = torch.load(_save(tmp_path), weights_only=False)
    path = tmp_path / f"{kind}.ckpt"
    if kind == "crc_off":
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(checkpoint, path)
        finally:
            torch.serialization.set_crc32_options(before)
    else:
        torch.save(checkpoint, path, _use_new_zipfile_serialization=False)
    trainer = _trainer(tmp_path, RESUMED_STEPS)
    trainer.fit(BoringModel(), ckpt_path=str(path))
    assert trainer.global_step == RESUMED_STEPS
    assert _unchecked(info_lines) == [f"The checkpoint {str(path)!r} {UNCHECKED}: {why}."]


def test_invalid_verify_setting_is_refused(tmp_path, monkeypatch):
    good = _save(tmp_path)
    monkeypatch.setenv("PL_CHECKPOINT_VERIFY", "2")
    trainer = _trainer(tmp_path, RESUMED_STEPS)
    with pytest.raises(MisconfigurationException, match=re.escape("`PL_CHECKPOINT_VERIFY` must be 0 or 1, got '2'")):
        trainer.fit(BoringModel(), ckpt_path=str(good))
    assert trainer.global_step == 0


@pytest.mark.timeout(60)
def test_ddp_flipped_bit_raises_on_every_rank(tmp_path):
    """DDP on 2 CPU ranks: each rank reads the whole memory-mapped file and checks every record it reads; a bit
    flipped in ``layer.weight``'s record raises a ``CheckpointError`` naming it on both ranks, before any batch."""
    results = run_scenario(verified_load_scenarios.__name__, "ddp_flipped_bit", tmp_path, timeout=45)
    record = results[0]["record"]
    for result in results:
        assert "CheckpointError" in result["error_types"], result
        assert f"flipped.ckpt' is corrupt: its record {record!r} (bytes " in result["error"], result
        assert f"'{verified_load_scenarios.FLIPPED_KEY}'" in result["error"]
        assert result["train_batches"] == 0, result
        assert result["global_step"] == verified_load_scenarios.SAVED_STEPS, result
