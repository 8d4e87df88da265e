"""Local checkpoint and root directories are resolved as in Lightning 1.6.5, also with fsspec versions whose local
filesystem has the protocols ``("file", "local")`` instead of ``"file"``."""
import os

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint


def test_model_checkpoint_resolves_a_local_dirpath(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert ModelCheckpoint(dirpath="link/ckpts").dirpath == os.path.realpath(tmp_path / "real" / "ckpts")


def test_trainer_normalises_a_local_default_root_dir(tmp_path):
    trainer = Trainer(default_root_dir=str(tmp_path / "a" / ".." / "b"), logger=False)
    assert trainer.default_root_dir == str(tmp_path / "b")
