"""``python -m pytorch_lightning.utilities.convert_checkpoint SRC DST --to dcp`` and ``named_optimizer_state``.

The source is a checkpoint of a single-device ``fit`` whose optimizer state is laid out as the fork's FSDP strategy
writes it: ``param_names``, and the tensors of each state key views into one record. The command line runs as a
real subprocess where the process itself matters (its progress bar and exit code once; killed or interrupted
mid-write, by ``convert_checkpoint_faults``, which slows torch's DCP file writes); elsewhere its ``main`` runs in
this process (with the writes failing, by ``convert_checkpoint_faults`` too), to spare the suite an interpreter
start (seconds, to import Lightning) per case.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_harness.multiprocess import ROOT
from fsdp_harness.tensor_compare import compare_tensors
from pytorch_lightning import seed_everything, Trainer
from pytorch_lightning.utilities import named_optimizer_state
from pytorch_lightning.utilities.convert_checkpoint import convert_checkpoint, main
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from tests.helpers.boring_model import BoringModel
from tests.utilities.convert_checkpoint_faults import enospc_after, hooked_create_stream

CLI = "pytorch_lightning.utilities.convert_checkpoint"
FAULTS = "tests.utilities.convert_checkpoint_faults"


class WideAdamModel(BoringModel):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 2))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _as_fsdp_layout(optimizer_state: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """The state as the fork's FSDP strategy writes it: named, each key's tensors views into one flat record."""
    state = {index: dict(entry) for index, entry in optimizer_state["state"].items()}
    for key in ("exp_avg", "exp_avg_sq"):
        record = torch.cat([entry[key].flatten() for entry in state.values()])
        offset = 0
        for entry in state.values():
            numel = entry[key].numel()
            entry[key] = record[offset : offset + numel].view_as(entry[key])
            offset += numel
    return dict(optimizer_state, state=state, param_names=names)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A checkpoint of 3 Adam steps on one device, in the fork's FSDP optimizer-state layout."""
    folder = tmp_path_factory.mktemp("source")
    seed_everything(7)
    model = WideAdamModel()
    trainer = Trainer(
        default_root_dir=folder, max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    path = folder / "fsdp.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    names = [name for name, _ in model.named_parameters()]
    checkpoint["optimizer_states"] = [_as_fsdp_layout(checkpoint["optimizer_states"][0], names)]
    torch.save(checkpoint, path)
    return path


def _read_dcp(directory: Path, source: Dict[str, Any]) -> Dict[str, Any]:
    """The DCP directory read back by torch's DCP reader into templates shaped like the source."""
    named = named_optimizer_state(source["optimizer_states"][0])
    template = {
        "model": {key: torch.full_like(value, float("nan")) for key, value in source["state_dict"].items()},
        "optim": {
            "state": {
                name: {key: torch.full_like(value, -1) for key, value in entry.items()}
                for name, entry in named["state"].items()
            },
            "param_groups": [dict(group, lr=None, params=None) for group in named["param_groups"]],
        },
    }
    dcp.load(template, checkpoint_id=str(directory), no_dist=True)
    return template


def _leftovers(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _cli(*argv: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", CLI, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _start_slow(*argv: Any) -> subprocess.Popen:
    """The command line with every DCP write slowed by 50 ms (every ``os.pwrite`` of ``--to safetensors``, one per
    converted tensor, by 1 s), writing progress and errors to its ``stdout``."""
    seconds = "1" if "safetensors" in map(str, argv) else "0.05"
    return subprocess.Popen(
        [sys.executable, "-m", FAULTS, "slow", seconds, "--", *map(str, argv)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )


def _wait_for_data_written(folder: Path, process: subprocess.Popen, timeout: float = 60) -> Path:
    """The work directory of the conversion, once it is writing tensors: its DCP data file holds more than the
    pickled values that DCP writes first (the groups' hyperparameters, a few KiB), or a safetensors file is there
    (``safetensors`` wrote it, the converted tensors are going into their places)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        for work in folder.glob(".*.converting"):
            if any(f.stat().st_size > 64 * 1024 for f in work.glob("*.distcp")) or any(work.glob("*.safetensors")):
                return work
        time.sleep(0.02)
    raise AssertionError("the conversion wrote no tensors in time")


def test_named_optimizer_state_shares_the_tensors(source):
    """The view keys the state and groups by name and shares every tensor."""
    checkpoint = torch.load(source, mmap=True, weights_only=True)
    state = checkpoint["optimizer_states"][0]
    named = named_optimizer_state(state)
    names = state["param_names"]
    assert list(named["state"]) == names and named["param_groups"][0]["params"] == names
    assert named["param_groups"][0]["lr"] == state["param_groups"][0]["lr"]
    for index, name in enumerate(names):
        for key, value in state["state"][index].items():
            assert named["state"][name][key] is value
        # torch's set_optimizer_state_dict replaces values in the dicts it is given
        assert named["state"][name] is not state["state"][index]
    # a DDP or single-device file has no names: given by the caller
    plain = {k: v for k, v in state.items() if k != "param_names"}
    assert named_optimizer_state(plain, param_names=names)["state"].keys() == named["state"].keys()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("param_names"), "holds no parameter names (`param_names`)"),
        (lambda s: s.update(param_names=s["param_names"][:-1]), "hold 6 parameters, but 5 parameter names"),
        (lambda s: s.update(fsdp_roots=[{}]), "FairScale's consolidated state per FSDP root"),
        (lambda s: s.update(fsdp_per_rank=[{}, {}]), "`flatten_parameters=False`"),
        (lambda s: s["param_groups"][0].update(params=[0, 1, 2, 3, 4, 4]), "not 0..5 once each"),
    ],
    ids=["no-names", "count", "fsdp-roots", "fsdp-per-rank", "indices"],
)
def test_named_optimizer_state_errors(source, change, message):
    state = dict(torch.load(source, mmap=True, weights_only=True)["optimizer_states"][0])
    state["param_groups"] = [dict(g) for g in state["param_groups"]]
    change(state)
    with pytest.raises(MisconfigurationException, match=re.escape(message)):
        named_optimizer_state(state)


def test_round_trip(source, tmp_path):
    """Every tensor of the model and the optimizer state, and the groups' hyperparameters, read back from the DCP
    directory by torch's DCP reader equal the source's bit for bit."""
    dst = tmp_path / "out.dcp"
    convert_checkpoint(source, dst, to="dcp", progress=False)
    checkpoint = torch.load(source, mmap=True, weights_only=True)
    read = _read_dcp(dst, checkpoint)
    expected = {"model": checkpoint["state_dict"], "optim": named_optimizer_state(checkpoint["optimizer_states"][0])}
    compared = compare_tensors(expected, read)
    assert compared["ok"], compared
    assert compared["compared"] == 6 + 6 * 3  # weights, and Adam's exp_avg, exp_avg_sq and step per parameter
    assert read["optim"]["param_groups"] == expected["optim"]["param_groups"]
    assert _leftovers(tmp_path) == []


def test_cli_shows_progress_and_refuses_to_overwrite(source, tmp_path, capsys):
    """The command line converts with a progress bar; a second run refuses to overwrite (exit code 2, one line, the
    directory untouched), and ``--force`` replaces it. The first run is the real command line; the others call its
    ``main`` in this process, to spare the suite two interpreter starts."""
    dst = tmp_path / "out.dcp"
    first = _cli(source, dst, "--to", "dcp")
    assert first.returncode == 0, first.stderr
    assert "100%" in first.stderr and "24/24 tensors" in first.stderr, first.stderr
    inode = dst.stat().st_ino

    with pytest.raises(SystemExit) as refused:
        main([str(source), str(dst), "--to", "dcp"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"python -m {CLI}: error: {dst} exists; pass `--force` (`force=True`) to replace it."
    ]
    assert dst.stat().st_ino == inode

    assert main([str(source), str(dst), "--to", "dcp", "--force", "--no-progress"]) in (None, 0)
    assert "%" not in capsys.readouterr().err
    assert dst.stat().st_ino != inode and sorted(p.name for p in dst.iterdir()) == [".metadata", "__0_0.distcp"]
    assert _leftovers(tmp_path) == []


def _bad_inputs(folder: Path, source: Path) -> Dict[str, Path]:
    checkpoint = torch.load(source, weights_only=False)
    files = {"text": folder / "notes.txt"}
    files["text"].write_text("not a checkpoint\n")
    variants = {
        "bare-state-dict": checkpoint["state_dict"],
        "no-state-dict": {k: v for k, v in checkpoint.items() if k != "state_dict"},
        "no-param-names": dict(checkpoint, optimizer_states=[
            {k: v for k, v in checkpoint["optimizer_states"][0].items() if k != "param_names"}
        ]),
        "fsdp-per-rank": dict(checkpoint, optimizer_states=[{"fsdp_per_rank": [{}, {}]}]),
        "fsdp-roots": dict(checkpoint, optimizer_states=[{"state": {}, "param_groups": [], "fsdp_roots": [{}]}]),
        "two-optimizers": dict(checkpoint, optimizer_states=checkpoint["optimizer_states"] * 2),
    }
    for name, content in variants.items():
        files[name] = folder / f"{name}.ckpt"
        torch.save(content, files[name])
    files["missing"] = folder / "missing.ckpt"
    return files


BAD_INPUTS = {
    "text": "cannot be read as a PyTorch checkpoint: ",
    "bare-state-dict": "is not a Lightning checkpoint: it holds no `state_dict` (found ['layer.0.bias',",
    "no-state-dict": "is not a Lightning checkpoint: it holds no `state_dict` (found ['callbacks',",
    "no-param-names": "The optimizer state holds no parameter names (`param_names`)",
    "fsdp-per-rank": "each FSDP process's own optimizer state (saved with `flatten_parameters=False`)",
    "fsdp-roots": "FairScale's consolidated state per FSDP root",
    "two-optimizers": "holds 2 optimizer states; torch's state-dict layout holds one optimizer",
    "missing": "is not a file",
}


def test_bad_input_is_refused(source, tmp_path, capsys):
    """Each file the converter cannot express: exit code 2, one line naming the file and what is wrong, nothing
    written."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    files = _bad_inputs(inputs, source)
    out = tmp_path / "out"
    out.mkdir()
    for name, message in BAD_INPUTS.items():
        with pytest.raises(SystemExit) as exit_info:
            main([str(files[name]), str(out / f"{name}.dcp"), "--to", "dcp", "--no-progress"])
        assert exit_info.value.code == 2, name
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and str(files[name]) in lines[0] and message in lines[0], (name, lines)
    assert list(out.iterdir()) == []


def _mounted_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return mounted.returncode == 0


@pytest.mark.parametrize("disk", ["tmpfs", "injected"])
def test_full_disk_leaves_nothing(source, tmp_path, disk, capsys, monkeypatch):
    """The disk fills up while the data file is written: exit code 1, a line naming the error, and nothing left.
    ``tmpfs``: a real 64 KiB filesystem (needs root to mount); ``injected``: DCP's writes fail with ``ENOSPC``."""
    folder = tmp_path / "disk"
    if disk == "tmpfs":
        if not _mounted_tmpfs(folder, "64k"):
            pytest.skip("cannot mount a tmpfs (not root)")
        assert source.stat().st_size > 2 * 64 * 1024
    else:
        folder.mkdir()
        monkeypatch.setattr(FileSystem, "create_stream", hooked_create_stream(enospc_after(100_000)))
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([str(source), str(folder / "out.dcp"), "--to", "dcp"])
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 1, stderr
        message = stderr.splitlines()[-1]
        assert message.startswith(f"python -m {CLI}: error: writing {folder / 'out.dcp'} failed; nothing was written: ")
        assert "OSError: [Errno 28] No space left on device" in message, message
        assert message.endswith(" free on its filesystem)"), message
        assert list(folder.iterdir()) == []
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", str(folder)], check=True)


#: the command-line options of each target layout in the fault tests (safetensors: converted, so written by pwrite)
TARGETS = {"dcp": ["--to", "dcp"], "safetensors": ["--to", "safetensors", "--dtype", "bfloat16"]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_killed_conversion_is_removed_by_the_next(source, tmp_path, target):
    """``kill -9`` while the data file is being written leaves the work directory; the next conversion into the
    folder (here in this process) removes it and succeeds."""
    dst = tmp_path / "out.dcp"
    process = _start_slow(source, dst, *TARGETS[target])
    try:
        work = _wait_for_data_written(tmp_path, process)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(30)
    assert process.returncode == -signal.SIGKILL
    assert work.is_dir() and not dst.exists()
    assert work.name.startswith(".out.dcp.") and f".{process.pid}." in work.name

    assert main([str(source), str(dst), *TARGETS[target], "--no-progress"]) in (None, 0)
    assert _leftovers(tmp_path) == [] and dst.is_dir()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("signum", "target"),
    # safetensors' writer is interrupted by SIGTERM only: Ctrl-C unwinds through the same cleanup
    [(signal.SIGTERM, "dcp"), (signal.SIGINT, "dcp"), (signal.SIGTERM, "safetensors")],
    ids=["SIGTERM-dcp", "SIGINT-dcp", "SIGTERM-safetensors"],
)
def test_interrupted_conversion_leaves_nothing(source, tmp_path, signum, target):
    """``SIGTERM`` (a scheduler's stop) or ``SIGINT`` (Ctrl-C) mid-write: the conversion removes its work directory
    and exits with 128 + the signal's number."""
    process = _start_slow(source, tmp_path / "out.dcp", *TARGETS[target])
    try:
        _wait_for_data_written(tmp_path, process)
        process.send_signal(signum)
        output = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    assert process.returncode == 128 + signum, output
    assert os.listdir(tmp_path) == [], output


def test_main_gives_back_the_callers_signal_handlers(source, tmp_path):
    """``main`` may run inside a larger program (here pytest): the handlers it installs for the conversion are the
    caller's again once it returns, whether it succeeded or failed."""
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert main([str(source), str(tmp_path / "out.dcp"), "--to", "dcp", "--no-progress"]) in (None, 0)
        with pytest.raises(SystemExit):
            main([str(source), str(tmp_path / "out.dcp"), "--to", "dcp", "--no-progress"])  # exists: refused
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
