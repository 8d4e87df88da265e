"""``fsdp_harness.runner``: a batch runs its cases in order in one launch, each test reads its own case, a failing
case names its error and stops the batch, and the cases after it say so; the ranks of a launch of several are forks
of one driver (``fsdp_harness.forked_ranks``), and the batches of one module too."""
import os
import signal
import time
from pathlib import Path

import pytest

from fsdp_harness.forked_ranks import forks_ranks, LAUNCHER_ENV
from fsdp_harness.runner import launch, ScenarioBatch, ScenarioBatches

MODULE = "tests.fork.runner_scenarios"


@pytest.mark.timeout(180)
def test_batch_runs_cases_in_order_in_one_process_and_reports_each(tmp_path):
    batch = ScenarioBatch(MODULE, tmp_path, devices=1, timeout=120)
    batch.add("failing", "fail", "--value", "expected", fails=True)
    batch.add("second", "echo", "--value", "b")
    batch.add("first", "echo", "--value", "a", first=True)
    (first,), (second,) = batch.results("first"), batch.results("second")
    assert (first["value"], first["earlier"]) == ("a", [])
    assert (second["value"], second["earlier"], second["pid"]) == ("b", ["a"], first["pid"])
    failure = batch.failure("failing")
    assert failure.returncode != 0 and "RuntimeError: injected failure expected" in failure.output
    with pytest.raises(AssertionError, match="rank 0 wrote no result"):
        batch.results("failing")


@pytest.mark.timeout(180)
def test_a_case_that_raises_stops_the_batch_and_names_itself(tmp_path):
    batch = ScenarioBatch(MODULE, tmp_path, devices=1, timeout=120)
    batch.add("before", "echo")
    batch.add("broken", "fail", "--value", "x")
    batch.add("after", "echo")
    assert batch.results("before")[0]["earlier"] == []
    with pytest.raises(AssertionError, match="(?s)rank 0 wrote no result.*RuntimeError: injected failure x"):
        batch.results("broken")
    with pytest.raises(AssertionError, match="case 'after': a rank wrote no result \\(case 'broken' raised before it"):
        batch.results("after")


FORKED = "tests.fork.forked_rank_scenarios"


@pytest.mark.skipif(not forks_ranks(2), reason=f"{LAUNCHER_ENV} sends scenario launches through Lightning's launcher")
@pytest.mark.timeout(180)
def test_ranks_are_forked_from_one_interpreter_as_an_external_launcher_starts_them(tmp_path):
    """Both ranks are forks of the driver, which imported the scenario module (and Lightning) once; each has the
    environment ``torchrun`` gives a rank and the ``rank_zero_only.rank`` a fresh interpreter computes from it; a
    rank 0 killed by a signal makes the launch end with that signal, as ``python -m`` rank 0 would."""
    batch = ScenarioBatch(FORKED, tmp_path, devices=2, timeout=120)
    batch.add("who", "who")
    rank0, rank1 = batch.results("who")
    assert (rank0["local_rank"], rank1["local_rank"]) == ("0", "1")
    assert (rank0["global_rank"], rank1["global_rank"]) == (0, 1)
    assert (rank0["rank_zero_only"], rank1["rank_zero_only"]) == (0, 1)
    assert rank0["driver"][1:] == ["-m", "fsdp_harness.forked_ranks", "--ranks", "2", FORKED, "batch", "--cases",
                                   str(tmp_path / "batch.json")]
    assert rank0["lightning_imported_by_driver"] is rank1["lightning_imported_by_driver"] is True
    assert rank0["pid"] != rank1["pid"]
    assert rank0["master"] == rank1["master"] and rank0["master"][0] == "127.0.0.1"
    killed = launch(FORKED, "killed_on_rank_0", tmp_path / "killed", "--value", "SIGTERM", timeout=120, grace=5)
    assert killed.returncode == -signal.SIGTERM, killed.output[-4000:]
    assert (tmp_path / "killed" / "rank1.json").exists()


@pytest.mark.skipif(not forks_ranks(2), reason=f"{LAUNCHER_ENV} sends scenario launches through Lightning's launcher")
@pytest.mark.timeout(180)
def test_the_batches_of_a_module_are_forked_from_one_driver(tmp_path):
    """Batches of several world sizes, with their own environments, run one after the other from one driver
    (``--plan``): each batch's ranks get their batch's environment, and each batch its own result."""
    batches = ScenarioBatches(FORKED, tmp_path)
    batches.batch("two", 2, 120, env={"PL_HARNESS_TEST_VALUE": "a"}).add("who-2", "who")
    batches.batch("one", 1, 120, env={"PL_HARNESS_TEST_VALUE": "b"}).add("who-1", "who")
    two, (one,) = batches.results("who-2"), batches.results("who-1")
    assert two[0]["driver"][1:5] == ["-m", "fsdp_harness.forked_ranks", "--plan", str(tmp_path / "plan.json")]
    assert two[0]["driver_pid"] == two[1]["driver_pid"] == one["driver_pid"]
    assert [r["value"] for r in two] == ["a", "a"] and one["value"] == "b"
    assert [r["local_rank"] for r in (*two, one)] == ["0", "1", "0"]


@pytest.mark.skipif(not forks_ranks(2), reason=f"{LAUNCHER_ENV} sends scenario launches through Lightning's launcher")
@pytest.mark.timeout(120)
def test_ranks_of_batches_sharing_a_driver_die_with_it(tmp_path):
    """A hung batch of a shared driver times out: the harness kills the driver's process group, and the ranks, in a
    process group of their own, die with the driver (``PR_SET_PDEATHSIG``) instead of outliving the test."""
    batches = ScenarioBatches(FORKED, tmp_path)
    batches.batch("two", 2, 10).add("hang", "hang")
    batches.batch("one", 1, 10).add("after", "who")
    with pytest.raises(AssertionError, match="timed out"):
        batches.results("hang")
    pids = [int((tmp_path / "two" / "hang" / f"pid{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie is dead
