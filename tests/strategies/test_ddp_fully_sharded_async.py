"""``DDPFullyShardedStrategy(async_checkpoint=True)``: streamed checkpoints written in the background.

The CPU tests' scenarios (``fsdp_async_scenarios.py``, which also runs ``fsdp_resume_scenarios``'s ``fit``) run in
two launches (``async_runs``): one of 2 ranks, whose last case kills its ranks (``SIGKILL``), then one of 1 rank,
which also saves into the killed run's folder. Each test checks its own cases; the first to run launches both.
"""
from pathlib import Path

import pytest

from fsdp_harness.runner import CasePlans, ScenarioBatch, ScenarioBatches
from pytorch_lightning.utilities.host_memory import format_bytes
from tests.helpers.fake_proc import FakeProc
from tests.helpers.runif import RunIf
from tests.strategies.fsdp_async_scenarios import HOST_MEMORY_UNITS, HOST_MEMORY_WIDTH
from tests.strategies.test_ddp_fully_sharded_resume import (
    batch_name,
    check_exact_resume,
    new_batches,
    plan_exact_resume,
)

SCENARIOS = "tests.strategies.fsdp_async_scenarios"
# the batches of ``async_runs``, in launch order (the names ``plan_exact_resume`` uses): world size and timeout
BATCHES = {batch_name(2): (2, 600), batch_name(1): (1, 180)}
# a test that reads ``async_runs`` may be the one that launches every batch
BATCHES_TIMEOUT = sum(timeout for _, timeout in BATCHES.values()) + 60
MAX_RAISE_SECONDS = 60

# the cases each test reads from ``async_runs``, queued only for the tests this session runs
PLANS = CasePlans()
queues = PLANS.queues


@pytest.fixture(scope="module")
def async_runs(request, tmp_path_factory) -> ScenarioBatches:
    return PLANS.queued_batches(request, SCENARIOS, tmp_path_factory.mktemp("async"), BATCHES)


def _two(batches: ScenarioBatches) -> ScenarioBatch:
    return batches.batch(batch_name(2), 2)


EXACT = [("adam", 2), ("sgd", 1)]


def plan_exact_resume_from_async_checkpoints(batches, case, optimizer, *extra, devices=2):
    plan_exact_resume(batches, case, optimizer, "--layout", "async", *extra, devices=devices)


def check_exact_resume_from_async_checkpoints(batches, case, devices=2, atol=0.0):
    check_exact_resume(batches, case, devices=devices, atol=atol)
    for run in ("straight", "resumed"):
        results = batches.results(f"{case}/{run}")
        assert [r["synchronous_reason"] for r in results] == [None] * devices
        # ModelCheckpoint's saves, one per epoch, were written in the background (the resumed run: the second)
        assert [r["background_saves"] for r in results] == [2 if run == "straight" else 1] * devices, results


def plan_exact(batches: ScenarioBatches) -> None:
    for optimizer, devices in EXACT:
        plan_exact_resume_from_async_checkpoints(batches, f"{optimizer}-{devices}", optimizer, devices=devices)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("optimizer", "devices"), EXACT)
@queues(plan_exact)
def test_exact_resume_from_async_checkpoints(async_runs, optimizer, devices):
    """ModelCheckpoint saves every epoch in the background while training goes on; resuming from the checkpoint of
    the first epoch gives the uninterrupted run's parameters, optimizer state and final checkpoint exactly."""
    check_exact_resume_from_async_checkpoints(async_runs, f"{optimizer}-{devices}", devices=devices)


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.timeout(600)
def test_exact_resume_from_async_checkpoints_multi_gpu(tmp_path):
    """The body of ``test_exact_resume_from_async_checkpoints[adam-2]`` on GPUs: pinned host copies, CUDA events."""
    batches = new_batches(tmp_path)
    plan_exact_resume_from_async_checkpoints(batches, "gpu", "adam", "--accelerator", "gpu")
    check_exact_resume_from_async_checkpoints(batches, "gpu", atol=1e-6)


def plan_failures(batches: ScenarioBatches) -> None:
    # rank 0 waits that long in the gather that rank 1's writer thread left
    _two(batches).add("failures", "failures", "--checkpoint-timeout", "10")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_failures)
def test_background_failures_raise_on_every_rank(async_runs):
    """Rank 0's disk fills up in the background (found by the next save, and by ``wait_for_checkpoint``), and rank 1
    fails while it sends its shard: every rank raises ``CheckpointError``, the previous file is intact, no temporary
    file is left, and the next save succeeds."""
    results = async_runs.results("failures")
    # the save returned while its file was still being written
    assert all(r["good"]["in_flight"] for r in results), results
    for index, (case, found_by) in enumerate(
        [("enospc", "next save"), ("enospc", "wait_for_checkpoint"), ("rank 1 send", "next save")]
    ):
        outcomes = [r["cases"][index] for r in results]
        assert all(o["case"] == case and o["found_by"] == found_by for o in outcomes), outcomes
        for rank, outcome in enumerate(outcomes):
            assert outcome["in_flight"], outcome
            assert outcome["raised"], f"rank {rank} did not raise: {outcome}"
            assert "CheckpointError" in outcome["mro"], outcome
            assert "in the background failed on global rank" in outcome["message"], outcome
            assert outcome["seconds"] < MAX_RAISE_SECONDS, outcome
            assert outcome["retry_ok"], outcome
        if case == "enospc":
            assert all("failed on global rank 0: OSError: [Errno 28]" in o["message"] for o in outcomes), outcomes
            assert "OSError" in outcomes[0]["mro"] and outcomes[0]["cause"].startswith("OSError"), outcomes[0]
        else:
            # rank 1's own error; rank 0 waited in the gather until the group's timeout
            assert "injected: the shard could not be sent" in outcomes[1]["cause"], outcomes[1]
            assert all("It also failed on global ranks [1]" in o["message"] for o in outcomes), outcomes
        zero = outcomes[0]
        assert zero["after"] == results[0]["before"], "the failed save changed the previous checkpoint"
        assert zero["tmp"] == [], zero


def plan_kill(batches: ScenarioBatches) -> None:
    """The kill ends the 2-rank batch; the 1-rank batch, launched after it, saves into the killed run's folder."""
    killed = _two(batches).add("kill", "kill", fails=True)
    batches.batch(batch_name(1), 1).add("cleanup", "cleanup", "--folder", killed / "ckpts")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_kill)
def test_kill_during_background_write_keeps_previous_file(async_runs):
    """``kill -9`` of every rank while rank 0's writer thread is writing: the previous file is intact, and the next
    save into the folder removes the dead writer's temporary file."""
    result = async_runs.failure("kill")
    assert not result.timed_out, result.output[-4000:]
    assert result.returncode == -9, f"exit code {result.returncode}; output:\n{result.output[-4000:]}"
    killed: Path = async_runs.folder("kill")
    before = (killed / "before.sha256").read_text()
    assert (killed / "tmp_before_kill.txt").read_text(), "the writer thread had not started"
    zero = async_runs.results("cleanup")[0]
    # listed by the next launch before it saved anything
    assert zero["debris"], "the killed writer left no temporary file"
    assert zero["before"] == before and zero["loads"], zero
    assert zero["tmp"] == [] and zero["equal"], zero


ORDERINGS = ["deferred", "broken"]


def plan_model_checkpoint(batches: ScenarioBatches) -> None:
    for ordering in ORDERINGS:
        broken = ["--broken-ordering"] if ordering == "broken" else []
        _two(batches).add(f"model_checkpoint-{ordering}", "model_checkpoint", *broken)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("ordering", ORDERINGS)
@queues(plan_model_checkpoint)
def test_model_checkpoint_never_leaves_no_complete_checkpoint(async_runs, ordering):
    """``save_top_k=1`` and ``save_last=True`` with slowed background writes: at every moment a complete top-k
    checkpoint is on disk, and ``best_model_path``/``last_model_path`` name committed files when ``fit`` returns.
    With the replaced file removed at once, as ``ModelCheckpoint`` asks (``broken``), the folder has moments without
    a complete top-k checkpoint, which the check sees."""
    results = async_runs.results(f"model_checkpoint-{ordering}")
    zero = results[0]
    assert zero["listings"] > 100, zero
    assert zero["fewest"] == {"all": 1, "top_k": 1 if ordering == "deferred" else 0}, zero
    assert zero["files"] == ["epoch=3.ckpt", "last.ckpt"], zero
    assert (zero["best"], zero["best_epoch"], zero["last"], zero["last_epoch"]) == ("epoch=3.ckpt", 3, "last.ckpt", 3)
    print(f"async saves ({ordering}): training-thread stall per save {[round(s, 3) for s in zero['stalls']]} s")


def plan_lifecycle(batches: ScenarioBatches) -> None:
    _two(batches).add("lifecycle", "lifecycle", "--checkpoint-timeout", "20")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_lifecycle)
def test_background_save_lifecycle(async_runs):
    """In one 2-rank run, with rank 0's writes slowed so that each save is still in flight at the next one:

    - ``ModelCheckpoint(filename="fixed", save_top_k=-1, every_n_train_steps=1)`` keeps as many files, with the same
      ``global_step``s, as the synchronous save: a name in flight counts as taken;
    - loggers' ``after_save_checkpoint`` sees each file only once it is committed;
    - a writer thread that cannot start on rank 1 makes every rank raise ``CheckpointError`` at once, with no thread,
      temporary file or descriptor left and the previous file intact, and the next save succeeds;
    - ``SIGINT`` on every rank mid-save, in a step and while waiting for the save: ``fit`` returns with the save
      committed, the file it replaced removed and the background group destroyed.
    """
    results = async_runs.results("lifecycle")
    zero = results[0]
    expected = {"fixed.ckpt": 1, "fixed-v1.ckpt": 2, "fixed-v2.ckpt": 3, "fixed-v3.ckpt": 4}
    assert zero["sync"]["files"] == expected, zero["sync"]
    assert zero["async"]["files"] == zero["sync"]["files"], zero["async"]
    for mode in ("sync", "async"):
        logged = zero[mode]["logged"]
        assert logged == [{"name": n, "exists": True, "step": s} for n, s in expected.items()], (mode, logged)
        assert zero[mode]["tmp"] == [], zero[mode]
        assert not any(r[mode]["async_group_left"] for r in results), results
    for rank, result in enumerate(results):
        outcome = result["start_fails"]
        assert outcome["raised"], outcome
        assert "CheckpointError" in outcome["mro"], outcome
        assert "failed on global rank 1: RuntimeError: can't start new thread" in outcome["message"], outcome
        assert outcome["seconds"] < 5, outcome
        assert (outcome["in_flight"], outcome["writer_threads"], outcome["open_tmp"]) == (False, 0, []), outcome
        assert outcome["retry_ok"], outcome
    assert zero["start_fails"]["unchanged"] and zero["start_fails"]["tmp"] == [], zero["start_fails"]
    for case in ("interrupted", "interrupted_waiting"):
        for result in results:
            interrupted = result[case]
            assert interrupted["status"] == "TrainerStatus.INTERRUPTED", interrupted
            assert interrupted["was_in_flight"], "the interrupt came with no save in flight: the test proves nothing"
            assert (interrupted["in_flight"], interrupted["writer_threads"]) == (False, 0), (case, interrupted)
            assert not interrupted["async_group_left"], (case, interrupted)
            assert interrupted["in_wait"] == (case == "interrupted_waiting"), (case, interrupted)
        # the save in flight was committed, and the file it replaces (save_top_k=1) removed, before `fit` returned
        assert zero[case]["files"] == {"step=2.ckpt": 2}, zero[case]
        assert zero[case]["tmp"] == [], zero[case]


HOST_MEMORY_SIZE = 4 * HOST_MEMORY_UNITS * (HOST_MEMORY_WIDTH * HOST_MEMORY_WIDTH + HOST_MEMORY_WIDTH)


def plan_host_memory(batches: ScenarioBatches) -> None:
    batch = _two(batches)
    fake = batch.folder("host_memory") / "fake"
    FakeProc(fake)
    size = HOST_MEMORY_SIZE
    headrooms = [3 * size, 4 * size, size, size // 4, size // 4]
    writers = ["rank0"] * 4 + ["all"]
    batch.add("host_memory", "host_memory", "--proc", fake, "--headrooms", *headrooms, "--writers", *writers)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_host_memory)
def test_host_copies_that_do_not_fit_are_saved_synchronously(async_runs):
    """Both ranks in one job cgroup (fake ``/proc`` and cgroup files). Each rank copies its half of the parameters and
    of Adam's two states (1.5 x S for a model of S bytes) and global rank 0 receives a unit from each rank (0.5 x S):
    with 3 x S left in the job the save is synchronous, complete, and says why; with 4 x S it goes to the background;
    then, its copies reused, 1 x S is enough. With S / 4 left, the copies reused, rank 0 has no room to receive the
    units (synchronous), but every rank writing its own copies (``checkpoint_writers="all"``) receives none."""
    size = HOST_MEMORY_SIZE
    fake = FakeProc(async_runs.folder("host_memory") / "fake", create=False)
    zero, one = async_runs.results("host_memory")
    for result in (zero, one):
        assert [save["background"] for save in result["saves"]] == [False, True, True, False, True], result
    assert [save["warnings"] for save in one["saves"]] == [[]] * 5
    assert [len(save["warnings"]) for save in zero["saves"]] == [1, 0, 0, 1, 0], zero["saves"]
    assert f"need about {format_bytes(size // 2)}" in zero["saves"][3]["warnings"][0]
    warning = zero["saves"][0]["warnings"][0]
    assert "this checkpoint is saved synchronously (streamed, as without `async_checkpoint`)" in warning
    copies = f"6 new copies of its shards, {format_bytes(3 * size // 2)}"
    receive = f"{format_bytes(size // 2)} to receive a unit from every rank"
    held = f"global rank 0: {copies} and {receive}; global rank 1: {copies}"
    assert f"need about {format_bytes(7 * size // 2)} ({held})" in warning, warning
    assert f"but the memory cgroup '{fake.job}'" in warning
    assert f"has only {format_bytes(3 * size)} available" in warning
    # the synchronous file holds the parameters and the optimizer state, as the files saved in the background do:
    # Adam's exp_avg, exp_avg_sq and step for each of the 4 parameters
    assert zero["complete"] and zero["optimizer_tensors"] == 12 and zero["equal"] == [True] * 4, zero
