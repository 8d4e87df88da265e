"""tests/standalone_tests.sh: one process per standalone test, under coverage, failing if any test fails."""
import shutil
import subprocess
import sys
import textwrap

from fork_tools.upstream import ROOT

SAMPLE = textwrap.dedent(
    """
    import os

    import pytest

    # What RunIf(standalone=True) produces: a skipif marker carrying standalone=True.
    standalone = pytest.mark.skipif(os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1", reason="x", standalone=True)


    @standalone
    def test_passes():
        with open(os.environ["PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")


    @standalone
    def test_fails():
        with open(os.environ["PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        assert False


    def test_not_standalone():
        raise AssertionError("must not run under standalone_tests.sh")
    """
)


def test_standalone_script_runs_each_test_in_own_process(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE)
    pids = tmp_path / "pids.txt"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PIDS": str(pids), "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "tests" / "standalone_tests.sh")], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "2 collected, 1 passed, 1 failed" in out
    assert "FAILED tests/test_sample.py::test_fails" in out
    assert "must not run" not in out
    assert len(set(pids.read_text().split())) == 2  # two tests, two processes
    assert (tmp_path / ".coverage").exists()
