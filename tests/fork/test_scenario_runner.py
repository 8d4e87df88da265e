"""``fsdp_harness.runner``: a batch runs its cases in order in one launch, each test reads its own case, a failing
case names its error and stops the batch, and the cases after it say so."""
import pytest

from fsdp_harness.runner import ScenarioBatch

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
