"""Only committed ``hpc_ckpt_<N>.ckpt`` files count when a job resumes from the newest HPC checkpoint of its root
directory and when the next HPC save is numbered (the fork/streaming-atomic-save patch): not the temporary files of
killed saves (``tests/helpers/checkpoint_debris.py``), nor other names containing ``hpc_ckpt_`` or ``ckpt_``. The
same folder on 2 FSDP ranks under SLURM is in ``tests/strategies/test_ddp_fully_sharded_hpc_resume.py``."""
from pathlib import Path
from typing import Optional

import pytest

from pytorch_lightning import Trainer
from pytorch_lightning.trainer.connectors.checkpoint_connector import CheckpointConnector
from tests.helpers.checkpoint_debris import debris, plant_hpc_debris

DEBRIS_KINDS = ["other host", "this host, writer dead", "earlier fork revision", "user's copy", "other checkpoint"]


def _resume_path(root: Path) -> Optional[str]:
    trainer = Trainer(default_root_dir=str(root), logger=False, enable_checkpointing=False, max_epochs=1)
    return trainer._checkpoint_connector._hpc_resume_path


def _commit(root: Path, *versions: int) -> None:
    for version in versions:
        debris(root, f"hpc_ckpt_{version}.ckpt")  # the content does not matter to the scan


@pytest.mark.parametrize("only", [None, *DEBRIS_KINDS])
def test_debris_never_counts_as_a_checkpoint(tmp_path, only):
    """Resume picks ``hpc_ckpt_2.ckpt`` and the next save is ``hpc_ckpt_3.ckpt``, whatever else the folder holds
    (``only``: one kind of debris; ``None``: all of them)."""
    _commit(tmp_path, 1, 2)
    planted = plant_hpc_debris(tmp_path)
    assert sorted(planted) == sorted(DEBRIS_KINDS)
    for kind, path in planted.items():
        if only is not None and kind != only:
            path.unlink()
    assert _resume_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_3.ckpt")


def test_a_folder_of_debris_only_holds_no_checkpoint(tmp_path):
    plant_hpc_debris(tmp_path)
    assert _resume_path(tmp_path) is None
    assert CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_1.ckpt")


def test_versions_compare_as_numbers(tmp_path):
    _commit(tmp_path, 2, 9, 10)
    debris(tmp_path, "hpc_ckpt_011.ckpt")  # not a name Lightning writes: its version would name another file
    assert _resume_path(tmp_path) == str(tmp_path / "hpc_ckpt_10.ckpt")
    assert CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_11.ckpt")
    assert CheckpointConnector.hpc_save_path(tmp_path / "missing") == str(tmp_path / "missing" / "hpc_ckpt_1.ckpt")
