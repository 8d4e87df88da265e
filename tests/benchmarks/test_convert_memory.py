"""Smoke test of the converter memory benchmark, run as a user runs it (``python -m fsdp_benchmarks.convert_memory``),
never imported: at a tiny size it completes, prints its table, and its JSON has one row per method. The benchmark's
own check (the converter's peak extra anonymous memory within twice the largest tensor plus 16 MiB) decides its
exit code; the figures themselves are not asserted here."""
import json
import os
import subprocess
import sys

import pytest

from fsdp_harness.multiprocess import ROOT

METHODS = ["converter", "converter-safetensors", "converter-from-dcp"]
ALL_METHODS = [
    "converter", "by-hand", "converter-safetensors", "by-hand-safetensors", "converter-from-dcp", "by-hand-from-dcp"
]
KEYS = {
    "method", "peak_extra_mb", "peak_extra_file_mb", "seconds", "file_mb", "largest_tensor_mb", "bound_mb", "ok",
    "init_mb",
}


@pytest.mark.timeout(300)
def test_convert_memory_benchmark_smoke(tmp_path):
    """The converter's three directions (the by-hand peers: the release test below)."""
    _run_smoke(tmp_path, METHODS)


@pytest.mark.release
@pytest.mark.timeout(600)
def test_convert_memory_benchmark_every_method(tmp_path):
    _run_smoke(tmp_path, ALL_METHODS)


def _run_smoke(tmp_path, methods):
    json_path = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        # each method is a process of its own
        [sys.executable, "-m", "fsdp_benchmarks.convert_memory", "--size-mb", "8", "--units", "4", "--json",
         str(json_path), "--out", str(tmp_path / "out"), "--timeout", "240", "--methods", ",".join(methods)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60 + 60 * len(methods),
    )
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "converter-safetensors" in proc.stdout and "converter-from-dcp" in proc.stdout  # the table
    results = json.loads(json_path.read_text())
    assert [r["method"] for r in results] == methods
    for result in results:
        assert KEYS <= set(result) and result["ok"], result
        assert result["largest_tensor_mb"] <= 2 and result["file_mb"] > 3 * 7
    expected = sorted([f"{method}.json" for method in methods] + ["source.ckpt", "source.dcp"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == expected
