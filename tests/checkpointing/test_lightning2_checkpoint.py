"""A checkpoint written by Lightning 2.x resumes with its loop and callback states (``fork/lightning2-checkpoints``).

Lightning 2.6 cannot be installed next to the fork, so the file is the fork's own checkpoint of the same run with
the ``loops`` and ``callbacks`` entries that Lightning 2.6.6 writes for it, as recorded from a real 2.6.6 file of
this module (``tools/lightning2_check.sh`` runs the real thing in Lightning 2.6's own environment).
"""
import warnings
from typing import Any, Dict

import pytest
import torch

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from tests.helpers import BoringModel

STEPS = 4  # per epoch; the file is written after one epoch


def _tracker(n: int, *fields: str) -> Dict[str, Any]:
    return {"current": {field: n for field in fields}, "total": {field: n for field in fields}}


def _batch_progress(n: int, last: bool) -> Dict[str, Any]:
    return {**_tracker(n, "ready", "started", "processed", "completed"), "is_last_batch": last}


def lightning2_loops(automatic: bool) -> Dict[str, Any]:
    """``checkpoint["loops"]`` as Lightning 2.6.6 writes it after one epoch of ``STEPS`` steps."""
    steps = STEPS if automatic else 0
    evaluation = {"state_dict": {}, "batch_progress": _batch_progress(0, False)}
    fit_loop = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": STEPS},
        "epoch_loop.batch_progress": _batch_progress(STEPS, True),
        "epoch_loop.scheduler_progress": _tracker(0, "ready", "completed"),
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {
                "step": _tracker(steps, "ready", "completed"),
                "zero_grad": _tracker(steps, "ready", "started", "completed"),
            }
        },
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": _tracker(STEPS - steps, "ready", "completed"),
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": _batch_progress(0, False),
        "epoch_progress": _tracker(1, "ready", "started", "processed", "completed"),
    }
    return {"fit_loop": fit_loop, "validate_loop": evaluation, "test_loop": evaluation, "predict_loop": evaluation}


class Model(BoringModel):
    def __init__(self, automatic: bool) -> None:
        super().__init__()
        self.automatic_optimization = automatic
        self.restored: Dict[str, Any] = {}

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return output
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(output["loss"])
        optimizer.step()

    def on_train_start(self) -> None:
        self.restored = {
            "global_step": self.trainer.global_step,
            "epoch": self.trainer.current_epoch,
            "best_model_path": self.trainer.checkpoint_callback.best_model_path,
        }



@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    # ``rank_zero_only.rank`` is process-wide: an in-process test that set up a strategy as another rank before this
    # one (same xdist worker) would silence the warning under test
    monkeypatch.setattr(rank_zero_only, "rank", 0)

def _fit(tmp_path, automatic: bool, epochs: int, ckpt_path=None) -> tuple:
    model = Model(automatic)
    trainer = Trainer(
        default_root_dir=tmp_path, max_epochs=epochs, limit_train_batches=STEPS, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model, [str(w.message) for w in caught]


def _lightning2_file(tmp_path, trainer: Trainer, automatic: bool, extra_loop_state: bool) -> str:
    """The fork's checkpoint of the run, with the loop and callback states Lightning 2.6.6 writes for it."""
    path = tmp_path / "fork.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    callback = trainer.checkpoint_callback
    (state,) = checkpoint["callbacks"].values()
    # Lightning 2.x's ModelCheckpoint state key lacks save_on_train_epoch_end
    key = (
        "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1,"
        " 'train_time_interval': None}"
    )
    checkpoint["callbacks"] = {key: state}
    checkpoint["loops"] = lightning2_loops(automatic)
    if extra_loop_state:
        checkpoint["loops"]["fit_loop"]["epoch_loop.loop_of_a_later_release.progress"] = _tracker(1, "ready")
    checkpoint["pytorch-lightning_version"] = "2.6.6"
    assert callback.best_model_path.endswith(f"epoch=0-step={STEPS}.ckpt")
    path = tmp_path / "lightning2.ckpt"
    torch.save(checkpoint, path)
    return str(path)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_lightning2_checkpoint_resumes_loops_and_callbacks(tmp_path, automatic):
    trainer, _, _ = _fit(tmp_path, automatic, epochs=1)
    best = trainer.checkpoint_callback.best_model_path
    path = _lightning2_file(tmp_path, trainer, automatic, extra_loop_state=False)

    trainer, model, messages = _fit(tmp_path, automatic, epochs=2, ckpt_path=path)

    assert model.restored == {"global_step": STEPS, "epoch": 1, "best_model_path": best}
    assert trainer.global_step == 2 * STEPS
    assert not [m for m in messages if "Please add the following callbacks" in m or "no counterpart" in m]


def test_lightning2_loop_state_without_counterpart_is_named(tmp_path):
    trainer, _, _ = _fit(tmp_path, automatic=False, epochs=1)
    path = _lightning2_file(tmp_path, trainer, automatic=False, extra_loop_state=True)

    trainer, model, messages = _fit(tmp_path, automatic=False, epochs=2, ckpt_path=path)

    assert model.restored["global_step"] == STEPS
    (message,) = [m for m in messages if "no counterpart" in m]
    assert "Lightning 2.6.6" in message
    assert message.endswith("not restored: fit_loop.epoch_loop.loop_of_a_later_release.progress.")
