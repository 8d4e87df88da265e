"""``--from dcp``: DCP directories (the converter's layout, torchtitan's, Lightning 2.x's) back into a fork
checkpoint file, one tensor at a time, which a Trainer resumes. (FSDP2's own sharded saves, resumed by the fork's
FSDP, DDP and one device on 2 and 1 ranks: ``tests/strategies/test_fsdp2_interop.py``.)"""
import io
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions

from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.utilities import named_optimizer_state
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint, import_dcp, main
from pytorch_lightning.utilities.dcp_import import _import_dcp
from tests.utilities.test_convert_checkpoint import source, WideAdamModel  # noqa: F401 (the fixture)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
def test_the_converters_layout_comes_back_and_resumes(source, tmp_path):  # noqa: F811
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    fresh = "starting fresh .*: the loops, the callbacks. state, a configured learning-rate scheduler"
    with pytest.warns(UserWarning, match=fresh):
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
    per-parameter hyperparameters, ``--add-prefix`` maps the names, and the step is the global step. The optimizer is
    built from named parameters, whose names torch keeps in each group: they are the source's, not the
    LightningModule's, and stay out of the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions

    torch.manual_seed(0)
    net = WideAdamModel().layer
    named = list(net.named_parameters())
    optimizer = torch.optim.Adam([{"params": named[:2], "lr": 0.01}, {"params": named[2:]}], lr=0.02)
    assert "param_names" in optimizer.state_dict()["param_groups"][0]
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
    assert not any("param_names" in g for g in state["param_groups"])
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2, 3, 4, 5]]
    native = optimizer.state_dict()["state"]
    for index, entry in native.items():
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), (index, key)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_the_command_line_imports_and_refuses(source, tmp_path, capsys):  # noqa: F811
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    with pytest.warns(UserWarning, match="starting fresh .*: the loops"):
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
    with pytest.warns(UserWarning, match="starting fresh .*: the loops"):
        main([str(tmp_path / "ckpt.dcp"), str(dst), "--from", "dcp"])
    assert [p.name for p in out.iterdir()] == ["back.ckpt"]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _llama_optimizer(net):
    """torchtitan's AdamW, with a group without weight decay (the norms), its learning rate a tensor."""
    decay = [p for p in net.parameters() if p.dim() > 1]
    rest = [p for p in net.parameters() if p.dim() <= 1]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": torch.tensor(2e-3)}]
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)


class _LlamaModule(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _llama()

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 64, (8, 6)), batch_size=2)

    def configure_optimizers(self):
        return _llama_optimizer(self.net)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_a_torchtitan_directory_of_a_hugging_face_model_comes_back_and_resumes(tmp_path, monkeypatch):
    """torchtitan's checkpoint of a (tiny, random) Llama: its keys at the top level (``model.*`` and ``lm_head``, so
    not the converter's ``model``), AdamW flattened (a tensor learning rate), ``train_state.step`` an int32 tensor,
    ``lr_scheduler`` and each rank's ``dataloader``: the file holds the model and AdamW's state, the step, and the
    warning names what is left out; ``.metadata`` is read once. The Trainer resumes it on one device (saved again at
    once: parameters and optimizer state equal by name)."""
    net = _llama()
    optimizer = _llama_optimizer(net)
    batch = torch.randint(0, 64, (2, 6))
    net(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    flattened = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(net, optimizer, options=flattened)
    state = {
        **model_state,
        "optimizer": optim_state,
        "train_state": {"step": torch.tensor(7, dtype=torch.int32), "ntokens_seen": torch.tensor(84)},
        "lr_scheduler": {"last_epoch": 7, "base_lrs": [1e-3, 2e-3], "_step_count": 8},
        "dataloader": {"dp_rank_0": io.BytesIO(b"sampler state")},
        "job_config": {"seq_len": 6},  # not the model's: left out
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    opened = []
    create_stream = FileSystem.create_stream

    def counting(self, path, mode):
        opened.append(str(path).rsplit("/", 1)[-1])
        return create_stream(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", counting)
    message = (
        r"global step 7; starting fresh \(not in the directory\): the loops, the callbacks' state, a configured"
        r" learning-rate scheduler; left out \(1.6.5 has no place for them\): train_state.ntokens_seen,"
        r" lr_scheduler.\*, dataloader.\*, job_config.\*"
    )
    with pytest.warns(UserWarning, match=message):
        _import_dcp(tmp_path / "tt", tmp_path / "back.ckpt", add_prefix="net.")
    assert opened.count(".metadata") == 1
    with pytest.raises(MisconfigurationException, match=r"names parameters the model does not have: \['model.embed"):
        _import_dcp(tmp_path / "tt", tmp_path / "other.ckpt", model_key="model")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert back["global_step"] == 7
    assert back["state_dict"].keys() == {f"net.{name}" for name in net.state_dict()}
    for name, value in net.state_dict().items():
        assert torch.equal(back["state_dict"][f"net.{name}"], value), name
    (saved,) = back["optimizer_states"]
    name_of = {id(p): f"net.{name}" for name, p in net.named_parameters()}
    in_optimizer_order = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    native = named_optimizer_state(optimizer.state_dict(), in_optimizer_order)
    named = named_optimizer_state(saved)
    for name, entry in native["state"].items():
        for key, value in entry.items():
            assert torch.equal(named["state"][name][key], value), (name, key)
    lrs = [group["lr"] for group in saved["param_groups"]]
    assert lrs[0] == 1e-3 and isinstance(lrs[1], torch.Tensor) and torch.equal(lrs[1], torch.tensor(2e-3))
    assert [sorted(g["params"]) for g in named["param_groups"]] == [sorted(g["params"]) for g in native["param_groups"]]

    monkeypatch.undo()
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=7, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(_LlamaModule(), ckpt_path=str(tmp_path / "back.ckpt"))
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    again = torch.load(tmp_path / "again.ckpt", weights_only=True)
    for name, value in back["state_dict"].items():
        assert torch.equal(again["state_dict"][name], value), name
    # one device saves the optimizer's own state: by index in the optimizer's order
    resumed = named_optimizer_state(again["optimizer_states"][0], in_optimizer_order)
    for name, entry in named["state"].items():
        for key, value in entry.items():
            assert torch.equal(resumed["state"][name][key], value), (name, key)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_a_model_only_directory_says_the_optimizer_starts_fresh(tmp_path):
    net = torch.nn.Linear(4, 3)
    dcp.save({"model": net.state_dict()}, checkpoint_id=str(tmp_path / "weights"), no_dist=True)
    torch.save({"epoch": 2, "global_step": 8, "loops": {}, "callbacks": {}, "lr_schedulers": []},
               tmp_path / "weights" / "meta.pt")
    with pytest.warns(UserWarning, match=r"starting fresh \(not in the directory\): the optimizer state\.$"):
        _import_dcp(tmp_path / "weights", tmp_path / "back.ckpt", add_prefix="net.")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert (back["epoch"], back["global_step"], back["optimizer_states"]) == (2, 8, [])


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_model_key_and_optim_key_override_the_detection(tmp_path, capsys):
    """Keys no writer this converter knows uses: the optimizer is found by its ``param_groups``, but its names are
    not the top-level model's until ``--model-key`` names the model's key; ``--optim-key`` names the optimizer."""
    net = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    _, optim_state = get_state_dict(net, optimizer)
    dcp.save({"weights": net.state_dict(), "sgd": optim_state}, checkpoint_id=str(tmp_path / "own"), no_dist=True)
    argv = [str(tmp_path / "own"), str(tmp_path / "back.ckpt"), "--from", "dcp", "--add-prefix", "net."]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "names parameters the model does not have: ['weight', 'bias']" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="starting fresh"):
        main([*argv, "--model-key", "weights", "--optim-key", "sgd"])
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert list(back["state_dict"]) == ["net.weight", "net.bias"]
    assert back["optimizer_states"][0]["param_names"] == ["net.weight", "net.bias"]
    expected = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(back["optimizer_states"][0]["state"][0]["momentum_buffer"], expected)
    for options, message in [
        (["--optim-key", "adam"], "holds no optimizer state under 'adam'"),
        (["--optim-key", "sgd", "--optim-key", "sgd"], "An optimizer key is given twice"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--force", "--model-key", "weights", *options])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, options


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_the_command_line_refuses_what_does_not_apply_and_a_broken_source(source, tmp_path, capsys):  # noqa: F811
    """Each direction's options are refused in the other; a directory is never replaced by the file; a URL is
    refused (object storage for the converter is not supported yet), and so are a file inside the source and a
    folder that does not exist (in both directions); a source whose data file is missing is refused (exit 2), not
    taken for a failed write; nothing is written."""
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    (tmp_path / "folder").mkdir()
    (tmp_path / "link.ckpt").symlink_to("folder")
    dcp_argv = [str(tmp_path / "ckpt.dcp"), str(tmp_path / "back.ckpt"), "--from", "dcp"]
    for argv, message in [
        ([*dcp_argv, "--strip-prefix", "model."], "--strip-prefix applies to --to safetensors only, not to --from"),
        ([*dcp_argv, "--tie", "a=b"], "--tie applies to --to safetensors only"),
        ([str(source), str(tmp_path / "d"), "--to", "dcp", "--add-prefix", "x."], "--add-prefix applies to --from"),
        ([str(tmp_path / "ckpt.dcp"), str(tmp_path / "folder"), "--from", "dcp", "--force"], "is a directory"),
        ([str(tmp_path / "ckpt.dcp"), str(tmp_path / "link.ckpt"), "--from", "dcp", "--force"], "is a symbolic link"),
        (["s3://bucket/run/step-10", str(tmp_path / "back.ckpt"), "--from", "dcp"], "s3://bucket/run/step-10 is a URL"),
        ([str(tmp_path / "ckpt.dcp"), str(tmp_path / "ckpt.dcp" / ".metadata"), "--from", "dcp", "--force"],
         "is inside the DCP directory"),
        ([str(tmp_path / "ckpt.dcp"), str(tmp_path / "no" / "back.ckpt"), "--from", "dcp"], "is not a directory"),
        ([str(source), str(tmp_path / "no" / "out.dcp"), "--to", "dcp"], "is not a directory: create it first"),
        ([str(tmp_path / "ckpt.dcp"), "s3://bucket/back.ckpt", "--from", "dcp"], "reads and writes local paths only"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    broken = tmp_path / "broken.dcp"
    shutil.copytree(tmp_path / "ckpt.dcp", broken)
    next(broken.glob("*.distcp")).unlink()
    with pytest.raises(SystemExit) as exit_info:
        main([str(broken), str(tmp_path / "back.ckpt"), "--from", "dcp", "--no-progress"])
    assert exit_info.value.code == 2 and "cannot be read" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.dcp", "ckpt.dcp", "folder", "link.ckpt"]


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch PAYLOAD_RAN",))


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
@pytest.mark.parametrize("meta", ["payload", "list", "truncated"])
def test_a_meta_pt_that_cannot_be_read_safely_is_refused(source, tmp_path, capsys, monkeypatch, meta):  # noqa: F811
    """Lightning 2.x's ``meta.pt`` goes through the fork's safe loader: one that names anything ``weights_only`` does
    not load is refused (exit 2) and its payload never runs; one that is not a checkpoint dict, or truncated, is
    refused too; nothing is written."""
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    value = {"epoch": 1, "hyper_parameters": {"x": _Payload()}} if meta == "payload" else [1, 2]
    torch.save(value, tmp_path / "ckpt.dcp" / "meta.pt")
    if meta == "truncated":
        data = (tmp_path / "ckpt.dcp" / "meta.pt").read_bytes()
        (tmp_path / "ckpt.dcp" / "meta.pt").write_bytes(data[: len(data) // 2])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "ckpt.dcp"), str(tmp_path / "back.ckpt"), "--from", "dcp", "--no-progress"])
    message = {"payload": "PL_UNSAFE_CHECKPOINT_LOAD=1", "list": "holds a list", "truncated": "cannot be read"}[meta]
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.dcp"]


class _WithExtraState(torch.nn.Linear):
    """A module with extra state (as Transformer Engine's layers have): DCP flattens it into entries of its own."""

    def get_extra_state(self):
        return {"scale": torch.full((2,), 3.0), "recipe": "delayed"}

    def set_extra_state(self, state):
        self.loaded_extra_state = state


class _TwoGroupModule(LightningModule):
    """Two param groups with the same hyperparameters (kept apart, e.g. for a per-group schedule; ``decay`` gives the
    second another weight decay), and a module with extra state."""

    def __init__(self, decay: float = 0.01):
        super().__init__()
        self.decay = decay
        self.net = torch.nn.Sequential(_WithExtraState(4, 4), torch.nn.Linear(4, 2))

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)

    def configure_optimizers(self):
        first, second = self.net[1].parameters(), self.net[0].parameters()
        groups = [{"params": first}, {"params": second, "weight_decay": self.decay}]
        return torch.optim.AdamW(groups, lr=1e-3)


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_merged_groups_and_extra_state_come_back_and_resume(tmp_path):
    """Flattened groups with equal hyperparameters come back as one group: the resume gives each of the
    LightningModule's groups its parameters by name; a LightningModule that configures those groups apart (another
    weight decay) is refused, as before. A module's extra state, flattened by DCP into a tensor and a non-tensor
    entry, comes back as the one value ``load_state_dict`` expects, and the (strict) resume loads it."""
    module = _TwoGroupModule()
    optimizer = module.configure_optimizers()
    module.net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(module.net, optimizer, options=options)
    dcp.save({**model_state, "optimizer": optim_state}, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    with pytest.warns(UserWarning, match="starting fresh"):
        _import_dcp(tmp_path / "tt", tmp_path / "back.ckpt", add_prefix="net.")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    extra = back["state_dict"]["net.0._extra_state"]
    assert extra["recipe"] == "delayed" and torch.equal(extra["scale"], torch.full((2,), 3.0))
    assert len(back["optimizer_states"][0]["param_groups"]) == 1  # merged: equal hyperparameters
    resumed = _TwoGroupModule()
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=0, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(resumed, ckpt_path=str(tmp_path / "back.ckpt"))
    assert resumed.net[0].loaded_extra_state["recipe"] == "delayed"
    name_of = {id(p): f"net.{name}" for name, p in module.net.named_parameters()}
    expected = named_optimizer_state(optimizer.state_dict(), [name_of[id(p)] for g in optimizer.param_groups
                                                               for p in g["params"]])
    loaded = trainer.optimizers[0]
    resumed_names = {id(p): f"net.{name}" for name, p in resumed.net.named_parameters()}
    assert [[resumed_names[id(p)] for p in g["params"]] for g in loaded.param_groups] == [
        g["params"] for g in expected["param_groups"]
    ]
    for p in resumed.net.parameters():
        for key, value in expected["state"][resumed_names[id(p)]].items():
            assert torch.equal(loaded.state[p][key], value), (resumed_names[id(p)], key)
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=0, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    with pytest.raises(MisconfigurationException, match="the checkpoint has 1 param groups, the optimizer 2"):
        trainer.fit(_TwoGroupModule(decay=0.0), ckpt_path=str(tmp_path / "back.ckpt"))


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to")
def test_a_torch_without_the_streamed_writer_is_refused(source, tmp_path, monkeypatch):  # noqa: F811
    """torch < 2.5 has no ``torch.serialization.skip_data``, which the file's writer needs."""
    convert_checkpoint(source, tmp_path / "ckpt.dcp", to="dcp", progress=False)
    monkeypatch.delattr(torch.serialization, "skip_data")
    with pytest.raises(MisconfigurationException, match="needs torch >= 2.5"):
        import_dcp(tmp_path / "ckpt.dcp", tmp_path / "back.ckpt")
    assert not (tmp_path / "back.ckpt").exists()
