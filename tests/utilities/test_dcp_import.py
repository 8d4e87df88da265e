"""``--from dcp``: DCP directories (the converter's layout, torchtitan's, Lightning 2.x's) back into a fork
checkpoint file, one tensor at a time, which a Trainer resumes."""
import pytest
import torch

from pytorch_lightning import Trainer
from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint, main
from pytorch_lightning.utilities.dcp_import import _import_dcp
from tests.utilities.test_convert_checkpoint import source, WideAdamModel  # noqa: F401 (the fixture)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_the_converters_layout_comes_back_and_resumes(source, tmp_path):  # noqa: F811
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    with pytest.warns(UserWarning, match="holds no Lightning loops, callbacks, lr_schedulers"):
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


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_a_torchtitan_style_directory_comes_back_and_resumes(tmp_path):
    """The model's keys at the top level, the optimizer state flattened (``flatten_optimizer_state_dict=True``) under
    ``optimizer``, with two groups of other learning rates and ``train_state``: the groups are rebuilt from the
    per-parameter hyperparameters, ``--add-prefix`` maps the names, and the step is the global step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions

    torch.manual_seed(0)
    net = WideAdamModel().layer
    rest = list(net[2].parameters()) + list(net[3].parameters())
    optimizer = torch.optim.Adam([{"params": net[0].parameters(), "lr": 0.01}, {"params": rest}], lr=0.02)
    net(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(net, optimizer, options=options)
    state = {**model_state, "optimizer": optim_state, "train_state": {"step": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    with pytest.warns(UserWarning, match="step 7"):
        _import_dcp(tmp_path / "tt", tmp_path / "back.ckpt", add_prefix="layer.")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert back["global_step"] == 7
    for name, value in net.state_dict().items():
        assert torch.equal(back["state_dict"][f"layer.{name}"], value), name
    (state,) = back["optimizer_states"]
    assert state["param_names"] == [f"layer.{name}" for name, _ in net.named_parameters()]
    assert [g["lr"] for g in state["param_groups"]] == [0.01, 0.02]
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2, 3, 4, 5]]
    native = optimizer.state_dict()["state"]
    for index, entry in native.items():
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), (index, key)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_the_command_line_imports_and_refuses(source, tmp_path, capsys):  # noqa: F811
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    with pytest.warns(UserWarning, match="holds no Lightning loops"):
        main([str(tmp_path / "ckpt.dcp"), str(tmp_path / "back.ckpt"), "--from", "dcp"])
    assert (tmp_path / "back.ckpt").is_file()
    for argv, message in [
        (["--from", "dcp"], "exists; pass `--force`"),
        (["--from", "dcp", "--to", "dcp"], "not allowed with argument"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path / "ckpt.dcp"), str(tmp_path / "back.ckpt"), *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), str(tmp_path / "other.ckpt"), "--from", "dcp"])
    assert exit_info.value.code == 2 and "is not a DCP checkpoint directory" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_a_lightning2_style_directory_brings_its_optimizers_and_meta(tmp_path):
    """Lightning 2.x's sharded layout: ``model``, ``optimizer_0``, ``optimizer_1`` (each keyed by parameter name) and
    ``meta.pt`` with the rest of its checkpoint: one optimizer state per optimizer, each with its own indices, and the
    loops, callbacks, epoch and step from ``meta.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    first, second = torch.optim.SGD([net.weight], lr=0.1, momentum=0.9), torch.optim.Adam([net.bias], lr=0.01)
    net(torch.randn(2, 4)).sum().backward()
    first.step(), second.step()
    model_state, optim_0 = get_state_dict(net, first)
    _, optim_1 = get_state_dict(net, second)
    dcp.save({"model": model_state, "optimizer_0": optim_0, "optimizer_1": optim_1}, checkpoint_id=str(tmp_path / "l2"),
             no_dist=True)
    loops = {"fit_loop": {"epoch_loop.automatic_optimization.optim_progress": {"optimizer_position": 1}}}
    torch.save({"epoch": 3, "global_step": 12, "loops": loops, "callbacks": {"cb": 1}, "lr_schedulers": [{"x": 1}]},
               tmp_path / "l2" / "meta.pt")
    _import_dcp(tmp_path / "l2", tmp_path / "back.ckpt", add_prefix="net.")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert (back["epoch"], back["global_step"], back["loops"], back["callbacks"]) == (3, 12, loops, {"cb": 1})
    sgd, adam = back["optimizer_states"]
    assert sgd["param_names"] == ["net.weight"] and adam["param_names"] == ["net.bias"]
    assert torch.equal(sgd["state"][0]["momentum_buffer"], first.state_dict()["state"][0]["momentum_buffer"])
    assert torch.equal(adam["state"][0]["exp_avg"], second.state_dict()["state"][0]["exp_avg"])
    assert sgd["param_groups"][0]["params"] == [0] and adam["param_groups"][0]["lr"] == 0.01


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_stopped_import_leaves_no_file_and_the_next_one_cleans_up(source, tmp_path, signal_name):  # noqa: F811
    """``--from dcp`` writes a file: nothing is at ``DST`` until it is complete. ``SIGTERM`` mid-write removes the
    temporary file; ``kill -9`` leaves it, and the next import into the folder removes it and succeeds."""
    import signal
    import subprocess
    import sys
    import time

    from fsdp_harness.multiprocess import ROOT

    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "back.ckpt"
    # every pwrite of the file slowed by 1 s (tests/utilities/convert_checkpoint_faults.py)
    argv = ["-m", "tests.utilities.convert_checkpoint_faults", "slow", "1", "--", str(tmp_path / "ckpt.dcp"), str(dst)]
    process = subprocess.Popen([sys.executable, *argv, "--from", "dcp"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("back.ckpt.*.tmp")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.02)
        process.send_signal(getattr(signal, signal_name))
        output = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    assert not dst.exists(), output
    if signal_name == "SIGTERM":
        assert process.returncode == 128 + signal.SIGTERM and list(out.iterdir()) == [], output
        return
    assert [p.name for p in out.iterdir()][0].startswith("back.ckpt.")
    with pytest.warns(UserWarning, match="holds no Lightning loops"):
        main([str(tmp_path / "ckpt.dcp"), str(dst), "--from", "dcp"])
    assert [p.name for p in out.iterdir()] == ["back.ckpt"]
