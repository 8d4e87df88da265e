"""``DDPFullyShardedStrategy``'s gloo checkpoint group and what travels over it, on 2 CPU ranks
(``tests/strategies/fsdp_checkpoint_group_scenarios.py``, see fsdp_harness/cpu_fsdp.py):

- the host-memory check before a gathered save counts what the ranks will hold on the path that runs (the
  consolidated optimizer state too, not for weights-only saves, nothing for streamed ones), reads the cgroup limit
  (fake ``/proc`` and cgroup files), and adds up the ranks under one limit;
- with ``flatten_parameters=False`` every rank's optimizer state reaches global rank 0 over the gloo checkpoint
  group, as CPU tensors, not over the FSDP (NCCL) group;
- a checkpoint group that cannot be created (gloo on an unusable interface) stops every rank in ``setup`` with an
  error naming ``GLOO_SOCKET_IFNAME``, and ``PL_CHECKPOINT_GLOO_GROUP=0`` trains without it;
- ``trainer.save_checkpoint`` called on global rank 0 alone raises after ``PL_CHECKPOINT_ARRIVAL_TIMEOUT``, naming the
  mistake, while a rank that is late within that bound saves.

The three scenarios run one after the other in ONE launch of the ranks (:class:`~fsdp_harness.runner.ScenarioBatch`),
each setting the environment variables it needs itself; ``gloo_group_fails`` runs last, after the gloo group that
could not be created.
"""
from pathlib import Path
from typing import NamedTuple

import pytest

from fsdp_harness.runner import ScenarioBatch, selected_tests
from tests.helpers.fake_proc import FakeProc
from tests.strategies.fsdp_checkpoint_group_scenarios import ARRIVAL_SECONDS

SCENARIOS = "tests.strategies.fsdp_checkpoint_group_scenarios"
BATCH_TIMEOUT = 420
#: the scenario each test reads, in the order they run (the failed group creation last)
CASES = {
    "test_host_memory_check_and_per_rank_optimizer_states": "host_memory",
    "test_save_called_on_global_rank_0_alone": "arrival",
    "test_checkpoint_group_that_cannot_be_created": "gloo_group_fails",
}


class Runs(NamedTuple):
    batch: ScenarioBatch
    fake: FakeProc  # the fake /proc and cgroup files of ``host_memory``


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Runs:
    """Queue the scenarios of the selected tests; the first test that reads one launches them all."""
    root = tmp_path_factory.mktemp("checkpoint_group")
    fake = FakeProc(root / "fake")
    fake.set_mem_available(2**40)  # the host has plenty: only the job's cgroup limit is tight
    batch = ScenarioBatch(SCENARIOS, root / "out", timeout=BATCH_TIMEOUT)
    selected = selected_tests(request)
    for test, scenario in CASES.items():
        if test in selected:
            batch.add(scenario, scenario, *(["--proc", root / "fake"] if scenario == "host_memory" else []))
    return Runs(batch, fake)


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_host_memory_check_and_per_rank_optimizer_states(runs):
    fake = runs.fake
    results = runs.batch.results("host_memory")
    for rank, result in enumerate(results):
        # rank 0 needs S for the state dict and 2 S for Adam's consolidated state
        assert result["gathered-2S"] is not None and "failed on global rank 0" in result["gathered-2S"], result
        message = result["gathered-2S"]
        assert "MemoryError: Gathering the checkpoint needs about 97.5 KiB of host memory" in message
        assert "global rank 0: the state dict, 32.5 KiB and the consolidated optimizer state, 65.0 KiB" in message
        assert f"the memory cgroup '{fake.job}'" in message
        assert result["weights-only-2S"] is None and result["gathered-3.5S"] is None
        assert result["streamed-0.5S"] is None and result["streamed-reason"] is None
        # with the state dict on every rank, the job's two ranks need 2 S together
        assert result["every-rank-1.5S"] is not None, result
        both = "global rank 0: the state dict, 32.5 KiB; global rank 1: the state dict, 32.5 KiB"
        assert both in result["every-rank-1.5S"]
        assert result["every-rank-2.5S"] is None
        assert result["per-rank"] is None
        # only global rank 1 sends, only global rank 0 receives (its size, then its pickled state), over gloo, on CPU
        expected = [{"op": "send" if rank else "recv", "device": "cpu", "checkpoint_group": True}] * 2
        assert result["p2p"] == expected, result["p2p"]
    assert not results[0]["gathered-2S-written"] and results[0]["gathered-3.5S-written"]
    assert results[0]["saved_states"] == [r["own_state"] for r in results]


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_checkpoint_group_that_cannot_be_created(runs):
    # with `PL_CHECKPOINT_TIMEOUT=5` (set by the scenario)
    results = runs.batch.results("gloo_group_fails")
    out: Path = runs.batch.folder("gloo_group_fails")
    for rank, result in enumerate(results):
        raised = result["raised"]
        assert raised is not None and raised.startswith("MisconfigurationException"), result
        assert "could not create the gloo process group" in raised
        assert "Unable to find address for: pl_no_such_if0" in raised  # global rank 1's cause, on every rank
        assert "GLOO_SOCKET_IFNAME" in raised and "PL_CHECKPOINT_GLOO_GROUP=0" in raised
        assert result["seconds"] < 60, result
        # the opt-out: no gloo group, training and saving work, and a failed save still stops every rank
        assert result["checkpoint_group"] == "None" and result["global_step"] == 2
        assert result["saved"] is None
        assert result["full_disk"] is not None and "failed on global rank 0: OSError" in result["full_disk"], result
    assert (out / "saved.ckpt").exists() and not (out / "full-disk.ckpt").exists()


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_save_called_on_global_rank_0_alone(runs):
    # with `PL_CHECKPOINT_ARRIVAL_TIMEOUT` at ARRIVAL_SECONDS (set by the scenario)
    zero, one = runs.batch.results("arrival")
    # global rank 1 began the save half the bound after global rank 0: it is saved
    for result in (zero, one):
        assert result["late"]["raised"] is None and result["late"]["group"] == "ProcessGroup", result
    assert zero["late"]["written"] and zero["late"]["seconds"] >= ARRIVAL_SECONDS / 2
    # global rank 0 alone: it stops once the bound has passed, with a message naming both causes
    alone = zero["alone"]
    assert ARRIVAL_SECONDS <= alone["seconds"] < ARRIVAL_SECONDS + 5, alone
    message = alone["raised"]
    assert message is not None and message.startswith("Saving the checkpoint to"), alone
    assert f"not every rank began it within {ARRIVAL_SECONDS:g} s (`PL_CHECKPOINT_ARRIVAL_TIMEOUT`)" in message
    assert "`trainer.save_checkpoint` is a collective call: every rank must make it" in message
    assert "`if trainer.is_global_zero:`" in message
    assert f"Otherwise a rank is more than {ARRIVAL_SECONDS:g} s behind the others" in message
    assert alone["group"] == "_ClosedCheckpointGroup" and not alone["written"]
    # the timed-out group is not used again: rank 0 raises at once, rank 1 finds it closed at once
    assert zero["closed"]["raised"].startswith("The gloo checkpoint group of this rank was closed after the ranks did")
    assert "not every rank began it" in one["closed"]["raised"], one["closed"]
    for result in (zero, one):
        assert result["closed"]["seconds"] < ARRIVAL_SECONDS and result["closed"]["group"] == "_ClosedCheckpointGroup"
        # replaced on every rank when the next stage set up
        assert result["replaced"]["raised"] is None and result["replaced"]["group"] == "ProcessGroup", result
    assert zero["replaced"]["written"] and not zero["closed"]["written"]
