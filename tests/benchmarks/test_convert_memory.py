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

METHODS = ["converter", "by-hand", "converter-safetensors"]
KEYS = {
    "method", "peak_extra_mb", "peak_extra_file_mb", "seconds", "file_mb", "largest_tensor_mb", "bound_mb", "ok",
}


@pytest.mark.timeout(300)
def test_convert_memory_benchmark_smoke(tmp_path):
    json_path = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        # the converter's two directions and the by-hand peer of one (each method is a process of its own)
        [sys.executable, "-m", "fsdp_benchmarks.convert_memory", "--size-mb", "8", "--units", "4", "--json",
         str(json_path), "--out", str(tmp_path / "out"), "--timeout", "240", "--methods", ",".join(METHODS)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=290,
    )
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "converter-safetensors" in proc.stdout and "by-hand" in proc.stdout  # the table
    results = json.loads(json_path.read_text())
    assert [r["method"] for r in results] == METHODS
    for result in results:
        assert KEYS <= set(result) and result["ok"], result
        assert result["largest_tensor_mb"] <= 2 and result["file_mb"] > 3 * 7
    expected = sorted([f"{method}.json" for method in METHODS] + ["source.ckpt"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == expected
