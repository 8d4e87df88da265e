"""A failure on one rank in the middle of a per-unit loop of FSDP checkpointing (the state-dict gather, the
optimizer-state consolidation, the per-unit model load, the optimizer re-shard) must not desynchronise the ranks:
every rank completes the same collectives and then raises ``CheckpointError``, naming the failing rank and the cause,
within seconds, and a failed save leaves the previous checkpoint byte-identical.

Runs ``tests/strategies/fsdp_collective_fault_scenarios.py`` on 2 CPU ranks (see fsdp_harness/cpu_fsdp.py); each
test prints ``collective fault <loop> on rank <R>: time-to-raise ...`` (run pytest with ``-s`` to see it).
Without the fix, the other rank waits in the next collective of the loop until the process group times out (here:
``run_module`` kills the ranks) or fails with an unrelated gloo error. Every case runs in one launch (``fault_runs``):
the scenarios destroy the process groups and undo their patches after each case.
"""
import pytest

from fsdp_harness.runner import ScenarioBatch

SCENARIOS = "tests.strategies.fsdp_collective_fault_scenarios"
MAX_RAISE_SECONDS = 60
WORLD_SIZE = 2
CASES = [
    (loop, rank)
    for loop in ("state_dict", "optimizer", "load", "reshard")
    for rank in (0, 1)
]
# with ``state_dict_on_rank_0_only`` only global rank 0 needs host memory for the state dict
CASES += [("state_dict_memory", 0)]
# every case in one launch, so a hang of one of them (killed at the batch's timeout) fails all of them
BATCH_TIMEOUT = 420


def fail_on(loop: str) -> str:
    # the first flat parameter's re-shard; one memory check
    return "1" if loop in ("reshard", "state_dict_memory") else "2"


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory: pytest.TempPathFactory) -> ScenarioBatch:
    root = tmp_path_factory.mktemp("collective_faults")
    batch = ScenarioBatch(SCENARIOS, root, timeout=BATCH_TIMEOUT, grace=MAX_RAISE_SECONDS + 5)
    for loop, fail_rank in CASES:
        batch.add(f"{loop}-{fail_rank}", loop, "--fail-rank", fail_rank, "--fail-on", fail_on(loop))
    return batch


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("loop, fail_rank", CASES)
def test_fault_in_per_unit_loop_raises_on_every_rank(fault_runs: ScenarioBatch, loop: str, fail_rank: int) -> None:
    memory = loop == "state_dict_memory"
    cause = "MemoryError: Gathering the checkpoint needs" if memory else "InjectedFault: injected fault"
    results = fault_runs.results(f"{loop}-{fail_rank}")
    assert results[fail_rank]["fault_raised_at"] == int(fail_on(loop)), results
    times = []
    for rank, outcome in enumerate(results):
        assert outcome["raised"], f"rank {rank} did not raise: {outcome}"
        assert "CheckpointError" in outcome["mro"], outcome
        assert f"failed on global rank {fail_rank}: {cause}" in outcome["message"], outcome
        assert outcome["seconds"] < MAX_RAISE_SECONDS, outcome
        if rank == fail_rank:
            assert outcome["cause"] and outcome["cause"].startswith(cause.split(":")[0]), outcome
        times.append(outcome["seconds"])
    if loop in ("state_dict", "state_dict_memory", "optimizer"):
        assert results[0]["before"] == results[0]["after"], "the failed save changed the previous checkpoint"
        assert results[0]["files"] == ["model.ckpt"], results[0]["files"]
    print(f"collective fault {loop} on rank {fail_rank}: time-to-raise {max(times):.3f}s (per rank {times})")


def test_loop_errors_are_kept_only_while_a_save_gathers_the_state() -> None:
    """Outside ``Trainer.save_checkpoint`` (a direct call of ``lightning_module_state_dict``, say) a failed loop
    raises at its end; during a save the first error is kept for the save to raise on every rank."""
    from pytorch_lightning.strategies import DDPFullyShardedStrategy
    from pytorch_lightning.strategies.fsdp_checkpoint_state import _SaveSession

    strategy = DDPFullyShardedStrategy()
    state = strategy._checkpoint_state
    with pytest.raises(ValueError, match="direct"):
        state.record_error(ValueError("direct"))
    assert state.session is None  # nothing kept the error
    session = state.session = _SaveSession(gathering=True)
    state.record_error(ValueError("first"))
    state.record_error(KeyError("second"))
    assert str(session.pop_error()) == "first"
    assert session.pop_error() is None
