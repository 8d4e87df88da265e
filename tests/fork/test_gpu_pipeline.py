"""What the GPU pipeline relies on: CUDA hidden from the CPU suite, the standalone step's condition, and the dry run
of tools/gpu_check.sh."""
import importlib.util
import os
import subprocess
import sys

from fork_tools.upstream import ROOT


def test_cpu_suite_hides_cuda():
    # set by tests/conftest.py outside the standalone run; every CPU-harness rank inherits it
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""


def test_standalone_step_runs_after_failed_unit_step():
    pipeline = (ROOT / ".azure-pipelines" / "gpu-tests.yml").read_text()
    step = pipeline.split("tests/standalone_tests.sh", 1)[1].split("- bash:", 1)[0]
    assert "condition: succeededOrFailed()" in step


def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_GPUS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout
    summary = (tmp_path / "summary.txt").read_text()
    assert "GPUs: 1, accelerator: gpu, benchmark ranks: 1, dry run" in summary
    assert "tests/standalone_tests.sh" in summary
    assert "-m fsdp_benchmarks.checkpoint_memory --accelerator gpu --devices 1" in summary
    assert "-m fsdp_benchmarks.pinned_host_rounding" in summary
    # the modules the script runs exist (a renamed package would otherwise only fail on the GPU machine)
    for part in summary.split(" -m ")[1:]:
        module = part.split()[0]
        assert importlib.util.find_spec(module) is not None, module
