"""Smoke tests of the shared-file write benchmark, run as a user runs it (``python -m
fsdp_benchmarks.shared_file_writes``), never imported: at a tiny size it completes, prints its table and writes the
documented JSON; and its check of the files can fail: where the filesystem stores one wrong byte (emulated in the
writing processes by a ``sitecustomize`` that changes the last byte of one ``pwrite``), it says so and exits 1. The
seconds are measured by the benchmark, never asserted here."""
import json
import os
import subprocess
import sys

import pytest

from fsdp_harness.multiprocess import ROOT

MODULE = "fsdp_benchmarks.shared_file_writes"
ROW_KEYS = {"procs", "seconds", "medians", "ratios", "errors"}
MODES = ["sparse", "preallocated", "direct", "own files"]

#: loaded by every process of the benchmark: the third ``pwrite`` of each writing process stores a wrong last byte, as
#: a filesystem that loses a write would leave it; or process 1 cannot create its own file (ENOSPC)
CORRUPTING_SITECUSTOMIZE = """
import os

if os.environ.get("CORRUPT_THIRD_PWRITE"):
    pwrite, calls = os.pwrite, []

    def corrupting(fd, data, offset):
        calls.append(1)
        if len(calls) != 3 or not os.readlink(f"/proc/self/fd/{fd}").endswith(".bin"):
            return pwrite(fd, data, offset)
        # in place, so that an O_DIRECT write keeps its aligned buffer
        view = memoryview(data).cast("B")
        view[-1] ^= 0xFF
        try:
            return pwrite(fd, data, offset)
        finally:
            view[-1] ^= 0xFF

    os.pwrite = corrupting

if os.environ.get("FAIL_OPEN_OWN_1"):
    import errno

    open_file = os.open

    def failing(path, *args, **kwargs):
        if str(path).endswith("own-1.bin"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return open_file(path, *args, **kwargs)

    os.open = failing
"""


def run_benchmark(tmp_path, *args, env=None):
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", MODULE, "--dir", str(tmp_path / "fs"), "--timeout", "30", *args], cwd=ROOT,
        env={**environment, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )


def run_two_processes_with_fault(tmp_path, fault, mb):
    """One run of 2 processes writing ``mb`` MiB each, with ``fault`` (a variable of the ``sitecustomize`` above) set
    in them; it must exit 1. Its output and its one row of results."""
    (tmp_path / "fs").mkdir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CORRUPTING_SITECUSTOMIZE)
    env = {fault: "1", "PYTHONPATH": str(tmp_path / "site")}
    json_path = tmp_path / "result.json"
    proc = run_benchmark(tmp_path, "--procs", "2", "--mb", mb, "--repeats", "1", "--json", str(json_path), env=env)
    assert proc.returncode == 1, proc.stdout[-8000:]
    result = json.loads(json_path.read_text())
    (row,) = result["rows"]
    return proc, row, [mode for mode in MODES if mode not in result["refused"]]


@pytest.mark.timeout(150)
def test_shared_file_writes_smoke(tmp_path):
    (tmp_path / "fs").mkdir()
    json_path = tmp_path / "result.json"
    proc = run_benchmark(tmp_path, "--procs", "1,2", "--mb", "16", "--repeats", "2", "--json", str(json_path))
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert all(mode in proc.stdout for mode in MODES)  # the table
    result = json.loads(json_path.read_text())
    assert result["mb_per_process"] == 16 and result["filesystem"] != "unknown"
    assert [row["procs"] for row in result["rows"]] == [1, 2]
    assert result["modes"] == MODES
    # a filesystem may refuse fallocate or O_DIRECT (tmpfs takes O_DIRECT from Linux 6.6 on); the others always run
    assert set(result["refused"]) <= {"preallocated", "direct"}
    run = [mode for mode in MODES if mode not in result["refused"]]
    for row in result["rows"]:
        assert ROW_KEYS <= set(row) and row["errors"] == []
        assert list(row["seconds"]) == run and all(len(runs) == 2 for runs in row["seconds"].values())
        assert all(seconds > 0 for runs in row["seconds"].values() for seconds in runs)
        assert all(row["ratios"][mode] > 0 for mode in run if mode != "own files")
    assert list((tmp_path / "fs").iterdir()) == []  # its files are removed


@pytest.mark.timeout(150)
def test_shared_file_writes_finds_a_wrong_byte(tmp_path):
    proc, row, run = run_two_processes_with_fault(tmp_path, "CORRUPT_THIRD_PWRITE", "24")
    assert "sparse, process 0, chunk 2: not the bytes written" in proc.stdout
    assert row["errors"] == [
        f"{mode}, process {process}, chunk 2: not the bytes written" for mode in run for process in (0, 1)
    ]


@pytest.mark.timeout(150)
def test_shared_file_writes_process_that_fails_stops_the_others(tmp_path):
    """Process 1 cannot create its own file: process 0, already waiting for it at the start, stops too (the barrier
    is broken) rather than waiting until ``--timeout``; both are reported and the benchmark exits 1."""
    _, row, run = run_two_processes_with_fault(tmp_path, "FAIL_OPEN_OWN_1", "8")
    assert row["errors"] == ["process 0 exited with 1", "process 1 exited with 1"], row
    assert all(row["seconds"][mode][0] > 0 for mode in run[:-1]) and row["seconds"]["own files"] == [None]
