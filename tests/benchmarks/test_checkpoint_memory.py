"""Smoke tests of the checkpoint-memory benchmark, run as a user runs it
(``python -m fsdp_benchmarks.checkpoint_memory`` or ``python fsdp_benchmarks/checkpoint_memory.py``), never imported: the tests and the benchmarks share only
``fsdp_harness``. At a tiny size it completes, the JSON has the documented schema, every configuration's checkpoint
is correct, and the plot is written. Memory figures are measured by the benchmark itself, never asserted here (they
are too noisy for a timed unit test)."""
import json
import os
import subprocess
import sys

import pytest

from fsdp_harness.multiprocess import ROOT

MODULE = "fsdp_benchmarks.checkpoint_memory"
CONFIGS = ["upstream", "rank0-only", "fork", "upstream-adam", "fork-adam"]
RUN_KEYS = {
    "config", "world_size", "state_dict_mb", "ranks", "node_save_peak_extra_mb", "node_load_peak_extra_mb",
    "checkpoint_mb", "ok",
}
RANK_KEYS = {"rank", "save_peak_extra_mb", "save_seconds", "load_peak_extra_mb", "load_seconds"}


def _environment():
    # As a user's shell has it: no repository root on PYTHONPATH, so only the benchmark itself can make it importable.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_benchmark(*args, cwd=ROOT, timeout=60, file_form=False):
    start = [str(ROOT / "fsdp_benchmarks" / "checkpoint_memory.py")] if file_form else ["-m", MODULE]
    return subprocess.run([sys.executable, *start, *args], cwd=cwd, env=_environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.mark.timeout(420)
def test_checkpoint_memory_benchmark_smoke(tmp_path):
    json_path, plot_path = tmp_path / "result.json", tmp_path / "result.png"
    proc = run_benchmark(
        "--devices", "2", "--size-mb", "8", "--units", "4", "--accelerator", "cpu", "--json", str(json_path),
        "--plot", str(plot_path), "--out", str(tmp_path / "out"), "--timeout", "180", timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "node" in proc.stdout  # the table

    result = json.loads(json_path.read_text())
    runs = result["runs"]
    assert [run["config"] for run in runs] == result["meta"]["configs"] == CONFIGS
    for run in runs:
        assert RUN_KEYS <= set(run), run
        assert run["ok"] is True
        assert run["world_size"] == 2
        assert 7 < run["state_dict_mb"] <= 8
        assert run["checkpoint_mb"] >= run["state_dict_mb"]
        assert [r["rank"] for r in run["ranks"]] == [0, 1]
        for rank in run["ranks"]:
            assert RANK_KEYS <= set(rank), rank
            assert all(isinstance(rank[k], float) for k in RANK_KEYS - {"rank"})
        assert run["node_save_peak_extra_mb"] == pytest.approx(sum(r["save_peak_extra_mb"] for r in run["ranks"]))
        assert run["node_load_peak_extra_mb"] == pytest.approx(sum(r["load_peak_extra_mb"] for r in run["ranks"]))
    assert plot_path.stat().st_size > 1000
    # --out keeps rank results and logs, but not the S-sized checkpoints
    assert not list((tmp_path / "out").rglob("*.ckpt"))


@pytest.mark.timeout(120)
def test_started_as_a_file_from_anywhere(tmp_path):
    """``python fsdp_benchmarks/checkpoint_memory.py`` imports its package and the harness from another folder too,
    and FairScale's top-level ``benchmarks`` package does not get in the way."""
    proc = run_benchmark("--help", cwd=tmp_path, file_form=True)
    assert proc.returncode == 0, proc.stdout
    assert "--devices" in proc.stdout and "--configs" in proc.stdout


@pytest.mark.timeout(120)
def test_unknown_configuration_is_rejected():
    proc = run_benchmark("--configs", "nope")
    assert proc.returncode == 2, proc.stdout
    assert "unknown configuration(s) ['nope']; known: " + ", ".join(CONFIGS) in proc.stdout
