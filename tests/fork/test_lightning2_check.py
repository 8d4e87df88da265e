"""tools/lightning2_check.sh without its network and its own environment: the dry run's plan, the argument handling,
and the PASS/FAIL line of ``tools.lightning2_compare`` for a run that raised or wrote nothing."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from fork_tools.upstream import ROOT

SCRIPT = ROOT / "tools" / "lightning2_check.sh"
CHECKS = (
    "fork FSDP file -> fork, 1 device",
    "fork FSDP file -> Lightning 2.6, 1 device",
    "Lightning 2.6 file -> fork FSDP, 2 ranks",
    "Lightning 2.6 full FSDP file -> fork FSDP, 2 ranks",
)


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*args], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=60, **kwargs,
    )


def test_dry_run_plans_the_environment_and_every_check(tmp_path):
    venv = tmp_path / "no-venv-yet"
    proc = _run("bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out"), "--venv", str(venv))
    assert proc.returncode == 0, proc.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "dry run" in summary.splitlines()[0]
    # its own environment, torch pinned first so that pip does not pull a CUDA build for lightning
    torch_step = summary.index(f"{venv}/bin/python -m pip install torch==2.13.0")
    assert summary.index(f"{venv}/bin/python -m pip install lightning==2.6.*") > torch_step
    for optimizer in ("sgd", "adam"):
        for check in CHECKS:
            assert f"would check ({check} ({optimizer}))" in summary
    assert "--strategy fork-fsdp --devices 2" in summary
    # Lightning 2.6's side runs the script by path, in its environment; the fork's side as a module of the tree
    assert f"{venv}/bin/python {ROOT}/tools/lightning2_resume.py fit" in summary
    assert importlib.util.find_spec("tools.lightning2_resume") is not None


def test_dry_run_reuses_an_existing_environment(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    proc = _run("bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out"), "--venv", str(venv))
    assert proc.returncode == 0, proc.stdout
    assert "pip install" not in (tmp_path / "out" / "summary.txt").read_text()


def test_unknown_argument_is_refused(tmp_path):
    proc = _run("bash", str(SCRIPT), "--out", str(tmp_path), "--frobnicate")
    assert proc.returncode == 2
    assert "unknown argument --frobnicate" in proc.stdout


def _compare(monkeypatch, capsys, *args) -> tuple:
    from tools import lightning2_compare

    monkeypatch.setattr(sys, "argv", ["lightning2_compare", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        lightning2_compare.main()
    return exit_info.value.code, capsys.readouterr().out.strip()


def test_check_fails_on_a_run_that_raised_or_wrote_nothing(tmp_path, monkeypatch, capsys):
    raised = tmp_path / "raised"
    raised.mkdir()
    (raised / "error.txt").write_text("Traceback (most recent call last):\nValueError: loaded state dict contains\n")
    assert _compare(monkeypatch, capsys, "case", "--run", raised) == (
        1, "FAIL case: the run raised ValueError: loaded state dict contains"
    )
    code, line = _compare(monkeypatch, capsys, "case", "--run", tmp_path / "empty")
    assert code == 1 and "wrote no checkpoint" in line


def test_loaded_state_must_be_the_files():
    from tools.lightning2_compare import _loaded_from_file

    group = {"lr": 0.1, "params": [0]}
    file = {"optimizer_states": [{"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(2)}},
                                  "param_groups": [group]}]}
    assert _loaded_from_file(file["optimizer_states"][0], file)[0]
    assert not _loaded_from_file({"state": {}, "param_groups": [group]}, file)[0]
    changed = {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.zeros(2)}}, "param_groups": [group]}
    assert not _loaded_from_file(changed, file)[0]
