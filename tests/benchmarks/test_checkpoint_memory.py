"""Smoke test of ``python -m benchmarks.checkpoint_memory`` at a tiny size: it completes, the JSON has the documented
schema, every configuration's checkpoint is correct, and the plot is written. Memory figures are measured by the
benchmark itself, never asserted here (they are too noisy for a timed unit test)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import configs
from tests.helpers.multiprocess import ROOT

RUN_KEYS = {
    "config", "world_size", "state_dict_mb", "ranks", "node_save_peak_extra_mb", "node_load_peak_extra_mb",
    "checkpoint_mb", "ok",
}
RANK_KEYS = {"rank", "save_peak_extra_mb", "save_seconds", "load_peak_extra_mb", "load_seconds"}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_checkpoint_memory_benchmark_smoke(tmp_path):
    json_path, plot_path = tmp_path / "result.json", tmp_path / "result.png"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable, "-m", "benchmarks.checkpoint_memory", "--devices", "2", "--size-mb", "8", "--units", "4",
        "--accelerator", "cpu", "--json", str(json_path), "--plot", str(plot_path), "--out", str(tmp_path / "out"),
        "--timeout", "180",
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "node" in proc.stdout  # the table

    runs = json.loads(json_path.read_text())["runs"]
    assert [run["config"] for run in runs] == configs.names()
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


def test_unknown_configuration_is_rejected():
    from benchmarks.checkpoint_memory import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--configs", "nope"])
    assert build_parser().parse_args(["--devices", "2,4"]).devices == [2, 4]
