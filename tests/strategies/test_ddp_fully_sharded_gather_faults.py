"""No hang when FairScale's own gather of a unit fails on one rank, when an allocation around the optimizer-state
gathers fails, or when global rank 0's disk is slow: before each collective of a checkpoint's per-unit loops the ranks
agree over the gloo checkpoint group that all of them can take part. A copy into a unit that fails on one rank while
the model state loads (without collectives) raises on every rank through the restore's failure exchange.

Runs ``tests/strategies/fsdp_gather_fault_scenarios.py`` on 2 CPU ranks (see fsdp_harness/cpu_fsdp.py); each test
prints its worst time to raise (run pytest with ``-s``). Without the agreement, the rank that did not fail waits in
the unit's all-gather (here: ``run_module`` kills the ranks after the timeout) or, the failing rank having gone on,
the two meet in different collectives and fail with an unrelated gloo error; with a slow disk, the other rank's next
gather times out on the FSDP process group.
"""
from typing import Any, Dict, List

import pytest

from fsdp_harness.runner import ScenarioBatch

SCENARIOS = "tests.strategies.fsdp_gather_fault_scenarios"
MAX_RAISE_SECONDS = 60
WORLD_SIZE = 2
ENV = {"PL_CHECKPOINT_TIMEOUT": "120"}
# the scenarios of ``gather_runs``, in one launch; ``slow_write`` last: without the checkpoint group's wait, its
# ranks would leave its save in different collectives, which the scenarios after it would inherit
BATCHED = ["streamed", "gathered", "load", "outside_loop", "allocations", "slow_write"]
BATCH_TIMEOUT = 540


@pytest.fixture(scope="module")
def gather_runs(tmp_path_factory: pytest.TempPathFactory) -> ScenarioBatch:
    root = tmp_path_factory.mktemp("gather_faults")
    batch = ScenarioBatch(SCENARIOS, root, WORLD_SIZE, timeout=BATCH_TIMEOUT, env=ENV, grace=30)
    for scenario in BATCHED:
        batch.add(scenario, scenario)
    return batch


def _check_case(results: List[Dict[str, Any]], index: int, action: str) -> float:
    """Every rank raised ``CheckpointError`` naming the failing rank and its ``MemoryError`` within the limit, the
    failing rank chained its own error, the previous checkpoint is unchanged and alone in its folder, and the retry in
    the same processes gave the same values. Returns the slowest rank's time to raise."""
    cases = [result["cases"][index] for result in results]
    fail_rank = cases[0]["fail_rank"]
    assert cases[fail_rank]["injected"] == 1, cases[fail_rank]
    for rank, case in enumerate(cases):
        assert case["raised"], f"rank {rank} did not raise: {case}"
        assert "CheckpointError" in case["mro"] and "MemoryError" in case["mro"], case
        assert case["message"].startswith(action), case
        assert f"failed on global rank {fail_rank}: MemoryError: CUDA out of memory" in case["message"], case
        assert case["seconds"] < MAX_RAISE_SECONDS, case
        if rank == fail_rank:
            assert case["cause"].startswith("MemoryError: CUDA out of memory"), case
        else:
            assert "This rank stops too" in case["message"], case
    zero = cases[0]
    assert zero["after"] == zero.get("before", results[0].get("before")), "the failed step changed the checkpoint"
    assert zero["files"] == ["model.ckpt"], zero["files"]
    assert all(case["retry_equal"] for case in cases if "retry_equal" in case), cases
    return max(case["seconds"] for case in cases)


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("path", ["streamed", "gathered", "load"])
def test_failure_inside_fairscale_gather_raises_on_every_rank(gather_runs: ScenarioBatch, path: str) -> None:
    """``_rebuild_full_params`` (saves), or torch's copy into the unit's parameters (the load, which gathers no unit),
    raises ``MemoryError`` on rank 0 and on rank 1, at the first, middle and last unit."""
    results = gather_runs.results(path)
    action = "Loading the model state from the checkpoint" if path == "load" else "Saving the checkpoint"
    cases = results[0]["cases"]
    assert [(c["fail_rank"], c["position"]) for c in cases] == [
        (rank, position) for rank in (0, 1) for position in ("first", "middle", "last")
    ]
    worst = max(_check_case(results, index, action) for index in range(len(cases)))
    # the FSDP units still gather in a forward and backward pass after the failures
    assert all(result["trains"] for result in results), results
    print(f"failure inside FairScale's gather, {path}: {len(cases)} cases, worst time to raise {worst:.3f}s")


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_failure_outside_the_loops_meets_them(gather_runs: ScenarioBatch) -> None:
    """A callback's ``state_dict`` raises on one rank between the model's gather and the optimizer state's: the
    other ranks' next agreement meets the failing rank's final exchange, and every rank raises."""
    results = gather_runs.results("outside_loop")
    worst = max(_check_case(results, index, "Saving the checkpoint") for index in range(2))
    assert all(result["trains"] for result in results), results
    print(f"failure outside the loops: 2 cases, worst time to raise {worst:.3f}s")


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_allocation_failures_around_optimizer_state_gathers(gather_runs: ScenarioBatch) -> None:
    """Rank 0's receive buffers, and a rank's move of its state after which the device stays out of memory:
    gathered and streamed, with and without ``cpu_offload``. After the OOM the failing rank allocates nothing."""
    results = gather_runs.results("allocations")
    cases = results[0]["cases"]
    assert {(c["trigger"], c["fail_rank"], c["layout"]) for c in cases} >= {
        ("empty_like", 0, "plain"),
        ("to", 1, "plain"),
        ("to", 0, "plain"),
        ("to", 1, "offload"),
        ("to", 0, "offload"),
    }
    worst = max(_check_case(results, index, "Saving the checkpoint") for index in range(len(cases)))
    for index in range(len(cases)):
        failing = results[cases[index]["fail_rank"]]["cases"][index]
        assert failing["allocations_after_oom"] == 0, failing
    assert all(result["trains"] for result in results), results
    print(f"allocation failures: {len(cases)} cases, worst time to raise {worst:.3f}s")


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_slow_rank_zero_write_waits_on_the_checkpoint_group(gather_runs: ScenarioBatch) -> None:
    """One write of rank 0 takes seconds past the FSDP groups' timeout: the save succeeds on every rank."""
    results = gather_runs.results("slow_write")
    zero = results[0]["cases"][0]
    # the sleep happened, and the other rank would have waited in the next gather well past the timeout
    assert zero["slept"] >= zero["group_seconds"] + 2 and zero["equal"], zero
    for rank, result in enumerate(results):
        case = result["cases"][0]
        assert not case["raised"], f"rank {rank}: {case}"
        assert case["seconds"] >= zero["slept"], case
