"""``--from dcp`` (work in progress): the converter's own DCP layout back into a fork checkpoint file, one tensor at
a time, which a Trainer resumes."""
import pytest
import torch

from pytorch_lightning import Trainer
from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint
from pytorch_lightning.utilities.dcp_import import _import_dcp
from tests.utilities.test_convert_checkpoint import source, WideAdamModel  # noqa: F401 (the fixture)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_the_converters_layout_comes_back_and_resumes(source, tmp_path):  # noqa: F811
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    with pytest.warns(UserWarning, match="holds no training state"):
        _import_dcp(tmp_path / "ckpt.dcp", tmp_path / "back.ckpt")
    original = torch.load(source, weights_only=False)
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert back["state_dict"].keys() == original["state_dict"].keys()
    for key, value in original["state_dict"].items():
        assert torch.equal(back["state_dict"][key], value), key
    (state,) = back["optimizer_states"]
    (before,) = original["optimizer_states"]
    assert state["param_names"] == before["param_names"]
    for index, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), (index, key)
    assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in before["param_groups"]]
    assert state["param_groups"][0]["lr"] == before["param_groups"][0]["lr"]
    model = WideAdamModel()
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=str(tmp_path / "back.ckpt"))
    assert trainer.global_step == 1
