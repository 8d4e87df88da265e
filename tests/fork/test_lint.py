"""``ruff`` (configured in ``pyproject.toml``) passes on the fork's own Python files, and only on those: the generated
``pytorch_lightning/`` is upstream's code plus the series, not ours to restyle. A test rather than a step of its own
in ``.ci/run``, so that CI stays the README's test command and ``pytest tests/fork`` checks it locally too."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = ("overlay", "fork_tools", "fsdp_harness", "fsdp_benchmarks", "tests", "setup.py")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    # ``--no-cache``: no ``.ruff_cache/`` in the checkout from a test run
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_covers_the_forks_files_only():
    listed = _ruff("check", "--show-files", ".")
    assert listed.returncode == 0, listed.stderr
    files = {Path(line.strip()).resolve().relative_to(ROOT).as_posix() for line in listed.stdout.splitlines()}
    assert not [f for f in files if f.startswith("pytorch_lightning/")], "the generated tree is linted"
    for own in OWN:
        assert any(f == own or f.startswith(own + "/") for f in files), f"{own} is not linted"


def test_ruff_passes():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
