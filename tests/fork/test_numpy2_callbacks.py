"""The installed fork on today's stack: ModelCheckpoint/EarlyStopping under numpy 2."""
from pathlib import Path

import numpy as np
import torch

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from tests.helpers import BoringModel


def test_checkpoint_and_early_stopping_under_numpy2(tmp_path):
    assert int(np.__version__.split(".")[0]) >= 2, f"this test is about numpy 2, found {np.__version__}"
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", mode="min", save_top_k=1)
    early_stopping = EarlyStopping(monitor="val_loss", mode="min", patience=1)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        limit_train_batches=4,
        limit_val_batches=2,
        callbacks=[checkpoint, early_stopping],
        enable_progress_bar=False,
        logger=False,
    )
    trainer.fit(BoringModel())

    written = list((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(written) == 1 and Path(checkpoint.best_model_path) == written[0]
    assert torch.isfinite(checkpoint.best_model_score)
    assert torch.isfinite(early_stopping.best_score)  # np.inf start value was replaced by a real loss
    state = torch.load(written[0], map_location="cpu", weights_only=False)
    assert "state_dict" in state and state["epoch"] >= 0
