"""``python -m pytorch_lightning.utilities.convert_checkpoint SRC DST --to safetensors``: a checkpoint's model weights
as the Hugging Face Hub lays them out (its end-to-end test, a GPT-2 trained under the fork's FSDP and loaded with
``transformers``, is in ``tests/strategies/test_ddp_fully_sharded_transformers.py``). The command's ``main`` runs in
this process."""
import json
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch
from safetensors import safe_open

from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint, main
from pytorch_lightning.utilities.exceptions import MisconfigurationException

CLI = "python -m pytorch_lightning.utilities.convert_checkpoint"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A Lightning checkpoint of a model under ``model.`` whose embedding is tied to its head (two records of equal
    values, as the fork's streamed save writes a tie), a loss module's weight outside it, and optimizer state."""
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(64, 32, generator=generator)
    stacked = torch.randn(32, 32, generator=generator)
    state_dict = {
        "model.embed.weight": embedding,
        "model.block.0.weight": torch.randn(32, 32, generator=generator),
        "model.block.0.bias": torch.randn(32, generator=generator),
        "model.block.1.weight": torch.randn(96, 32, generator=generator),
        "model.head.weight": embedding.clone(),
        # the embedding's shape, other values: an untied output layer
        "model.unembed.weight": torch.randn(64, 32, generator=generator),
        "model.norm.num_batches_tracked": torch.tensor(7),
        # the layouts a checkpoint may hold: a 0-dim scalar, a transposed view, a view at an offset into a storage
        # another weight holds, an empty tensor
        "model.scale": torch.tensor(2.5),
        "model.proj.weight": torch.randn(48, 32, generator=generator).t(),
        "model.stacked.weight": stacked,
        "model.stacked_tail.weight": stacked[16:],
        "model.empty": torch.empty(0, 4),
        "loss_fn.weight": torch.ones(4),
    }
    path = tmp_path_factory.mktemp("source") / "last.ckpt"
    optimizer_state = {"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(11))}]}
    torch.save({"state_dict": state_dict, "optimizer_states": [optimizer_state], "epoch": 1, "global_step": 8}, path)
    return path


def _read(directory: Path) -> Dict[str, Dict[str, torch.Tensor]]:
    """Each ``.safetensors`` file of ``directory``: its tensors, read by ``safetensors``."""
    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}, path
            files[path.name] = {key: f.get_tensor(key) for key in f.keys()}
    return files


def _convert(capsys, *argv: str) -> str:
    main([*argv, "--no-progress"])
    return capsys.readouterr().err


def test_one_file_holds_every_weight_under_the_prefix_without_it(source, tmp_path, capsys):
    """One shard: ``model.safetensors`` and no index; every name of the model (both of the tie) with its values; the
    loss module's weight listed in one line and left out."""
    dst = tmp_path / "hub"
    with pytest.warns(UserWarning, match=r"^Left out \(not tensors under 'model\.'\): loss_fn\.weight\.$"):
        _convert(capsys, str(source), str(dst), "--to", "safetensors", "--strip-prefix", "model.")
    state_dict = torch.load(source, weights_only=True)["state_dict"]
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    (tensors,) = _read(dst).values()
    expected = {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}
    assert sorted(tensors) == sorted(expected)
    for key, value in expected.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hub"]


def test_shards_follow_the_size_limit_with_an_index(source, tmp_path, capsys):
    """Shards of at most ``--max-shard-size`` (decimal units), named as the Hub names them, a tensor larger than the
    limit in a shard of its own; the index maps every weight to its shard and gives the total size."""
    dst = tmp_path / "hub"
    # 12 kB: the 12,288-byte block.1.weight alone is larger
    with pytest.warns(UserWarning, match="Left out"):
        _convert(capsys, str(source), str(dst), "--to", "safetensors", "--strip-prefix", "model.", "--max-shard-size",
                 "12kB")
    files = _read(dst)
    count = len(files)
    assert count >= 3 and sorted(files) == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert any(list(tensors) == ["block.1.weight"] for tensors in files.values())
    for tensors in files.values():
        if list(tensors) != ["block.1.weight"]:
            assert sum(t.nbytes for t in tensors.values()) <= 12_000
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {key: name for name, tensors in files.items() for key in tensors}
    assert index["metadata"]["total_size"] == sum(t.nbytes for tensors in files.values() for t in tensors.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_converts_and_a_named_tie_is_dropped_only_if_equal(source, tmp_path, capsys, dtype):
    name = str(dtype).split(".")[-1]
    dst = tmp_path / "hub"
    with pytest.warns(UserWarning, match="Left out"):
        _convert(capsys, str(source), str(dst), "--to", "safetensors", "--strip-prefix", "model.", "--dtype", name,
                 "--tie", "embed.weight=head.weight", "--max-shard-size", "8kB")
    state_dict = torch.load(source, weights_only=True)["state_dict"]
    tensors = {key: value for shard in _read(dst).values() for key, value in shard.items()}
    assert "head.weight" not in tensors and "embed.weight" in tensors
    for key, value in tensors.items():
        if key == "norm.num_batches_tracked":  # not a weight: it keeps its dtype
            assert value.dtype == torch.int64 and value.item() == 7
            continue
        assert value.dtype == dtype and torch.equal(value, state_dict[f"model.{key}"].to(dtype)), key


def test_values_beyond_float16_are_named(tmp_path, capsys):
    """A weight with values beyond float16's range (65504) becomes inf there: the conversion says which, once."""
    source = tmp_path / "big.ckpt"
    # an inf of the source's own is not an overflow
    state_dict = {
        "model.small": torch.ones(3),
        "model.big": torch.tensor([1.0, 1e6]),
        "model.inf": torch.tensor([1.0, float("inf")]),
    }
    torch.save({"state_dict": state_dict}, source)
    with pytest.warns(UserWarning, match=r"^Values beyond torch\.float16's range became inf in: big\.$"):
        _convert(capsys, str(source), str(tmp_path / "hub"), "--to", "safetensors", "--strip-prefix", "model.",
                 "--dtype", "float16")
    (tensors,) = _read(tmp_path / "hub").values()
    assert torch.isinf(tensors["big"][1]) and tensors["small"].dtype == torch.float16


def test_a_tie_whose_values_differ_is_refused(source, tmp_path, capsys):
    """``--tie`` never drops by name alone: a duplicate with other values (a head trained apart) is an error, and
    nothing is written; so is a name that is not there."""
    for tie, message in [
        ("embed.weight=unembed.weight", "the two weights differ"),
        ("embed.weight=block.0.weight", "the two weights differ"),
        ("embed.weight=lm_head.weight", "no weight 'lm_head.weight'"),
        ("embed.weight", "KEEP=DROP"),
    ]:
        with pytest.raises(SystemExit) as exit_info, pytest.warns(UserWarning, match="Left out"):
            _convert(capsys, str(source), str(tmp_path / "hub"), "--to", "safetensors", "--strip-prefix", "model.",
                     "--tie", tie)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bad_options_are_refused(source, tmp_path, capsys):
    cases = [
        (["--to", "dcp", "--strip-prefix", "model."], "--strip-prefix applies to --to safetensors only"),
        (["--to", "safetensors", "--strip-prefix", "net."], "No tensor of the checkpoint's `state_dict` is under"),
        (["--to", "safetensors", "--max-shard-size", "lots"], "`--max-shard-size lots`"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            _convert(capsys, str(source), str(tmp_path / "out"), *argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    with pytest.raises(MisconfigurationException, match="Unknown dtype 'int8'"):
        convert_checkpoint(source, tmp_path / "out", to="safetensors", dtype="int8")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("package", ["safetensors", "huggingface_hub"])
def test_a_missing_package_says_how_to_install_it(source, tmp_path, capsys, monkeypatch, package):
    """Without ``safetensors`` or ``huggingface_hub`` (their import fails, as where they are not installed) the
    command says which is missing and how to install both, and writes nothing."""
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(SystemExit) as exit_info:
        _convert(capsys, str(source), str(tmp_path / "hub"), "--to", "safetensors")
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith(f"{CLI}: error: ") and message.count("\n") == 1, message
    assert f"({package} is missing or too old): `pip install -U safetensors huggingface_hub`" in message, message
    assert list(tmp_path.iterdir()) == []
