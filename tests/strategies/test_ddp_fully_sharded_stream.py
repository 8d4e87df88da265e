"""Streamed FSDP saves (``DDPFullyShardedStrategy(stream_checkpoint=True)``, the default): global rank 0 writes the
checkpoint while the FSDP units and their optimizer state are gathered one at a time.

The file must be the one the gathered save writes (``stream_checkpoint=False``), entry by entry, for models with
nested and auto-wrapped FSDP instances, tied weights, buffers and parameters outside FSDP, with SGD and Adam, full and
weights-only, on 2 ranks and on 1. Scenarios in ``fsdp_stream_scenarios.py`` run real FairScale FSDP on CPU processes
over gloo. Exact resume from streamed checkpoints is checked in ``test_ddp_fully_sharded_resume.py``.
"""
from pathlib import Path
from typing import Any, Dict, List

import pytest

from fsdp_harness.multiprocess import assert_success, run_module
from fsdp_harness.scenario import read_results

SCENARIOS = "tests.strategies.fsdp_stream_scenarios"


def run_scenario(name: str, out: Path, *args: str, devices: int = 2, timeout: float = 240) -> List[Dict[str, Any]]:
    result = run_module(SCENARIOS, [name, "--out", str(out), "--devices", str(devices), *args], timeout=timeout)
    assert_success(result)
    return read_results(out, devices)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("model", "wrapping", "optimizer", "devices"),
    [
        ("plain", "wrap", "sgd", 2),
        ("tied", "wrap", "adam", 2),
        ("plain", "auto_wrap", "adam", 2),
        ("tied", "wrap", "sgd", 1),
    ],
)
def test_streamed_checkpoint_equals_gathered_checkpoint(tmp_path, model, wrapping, optimizer, devices):
    args = ("--model", model, "--wrapping", wrapping, "--optimizer", optimizer)
    rank0 = run_scenario("streamed_equals_gathered", tmp_path, *args, devices=devices)[0]
    for suffix in ("", "-weights"):
        assert rank0[f"stream_reason{suffix}"] is None  # the save was streamed
        assert rank0[f"differences{suffix}"] == []
        assert rank0[f"weights_only_loads{suffix}"] > 0  # ``torch.load(weights_only=True)`` reads the streamed file
    # model and optimizer state tensors, all compared
    assert rank0["tensors"] > rank0["tensors-weights"] >= 8
    assert rank0["temporary_files"] == []


@pytest.mark.timeout(300)
def test_hook_that_reads_the_state_gets_a_gathered_save(tmp_path):
    """``on_save_checkpoint`` sees the values, as before: an overridden hook makes the save gathered, and says so."""
    rank0 = run_scenario("streamed_equals_gathered", tmp_path, "--model", "hook")[0]
    assert rank0["stream_reason"] == "`ReadsStateOnSave.on_save_checkpoint` may read or replace the state's tensors"
    assert rank0["first_value"][0] == rank0["first_value"][1]
    assert rank0["differences"] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fail_rank", "fail_at"), [(0, "skeleton"), (0, "gather"), (1, "gather")])
def test_failure_while_streaming_keeps_the_previous_checkpoint(tmp_path, fail_rank, fail_at):
    """Rank 0 running out of disk space while writing the file's structure or its units, or another rank failing
    its part of a unit's gather: every rank raises the same ``CheckpointError``, the previous file is untouched, no
    temporary file is left, and the next save works."""
    results = run_scenario("fails_while_streaming", tmp_path, "--fail-rank", str(fail_rank), "--fail-at", fail_at)
    expected = "No space left on device" if fail_rank == 0 else "injected failure moving optimizer state"
    for result in results:
        assert f"failed on global rank {fail_rank}" in result["raised"]
        assert expected in result["raised"]
    assert results[0]["unchanged"] is True
    assert results[0]["temporary_files"] == []
    assert results[0]["after_loads"] == 8
