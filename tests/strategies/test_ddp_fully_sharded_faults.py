"""Checkpointing under faults with DDPFullyShardedStrategy on 2 CPU processes (see fsdp_harness/cpu_fsdp.py).

A failed checkpoint write on rank 0 and a bad checkpoint on resume must stop every rank within seconds with an
error naming the file, without relying on process-group timeouts, and must never cost the last good checkpoint.

The save and resume faults run in ONE launch (:class:`~fsdp_harness.runner.ScenarioBatch`): each of them raises on
every rank, which the scenario catches and records (``--caught``) with the time of the raise, so the next case runs in
the same processes; a rank that carried on after the fault would return a record without the error, and a rank
that hung would stall the batch. The last case of the batch, ``resume_bad[rank1_only]`` (a load that fails on one
rank only, the case in which the other rank would wait in a collective), lets its error escape, so that the test
also sees the processes themselves exit. The kill of rank 0 ends the processes by nature: its two cases launch
alone. ``run_module`` kills all ranks at ``timeout``, and the ranks other than rank 0 get ``GRACE`` seconds after
rank 0 exits, so a rank that hangs makes the time-to-exit exceed ``MAX_EXIT_SECONDS``.

Each test prints ``fault scenario <name>: ...`` with the seconds from the fault (run pytest with ``-s`` to see it).
"""
import hashlib
import json
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest

from fsdp_harness.multiprocess import ScriptResult
from fsdp_harness.runner import ScenarioBatch, launch, selected_tests
from pytorch_lightning.utilities.cloud_io import atomic_save

SCENARIOS = "tests.strategies.fsdp_fault_scenarios"
MAX_EXIT_SECONDS = 60
GRACE = MAX_EXIT_SECONDS + 5
WORLD_SIZE = 2
BATCH_TIMEOUT = 300

SAVE_ERRORS = ["enospc", "custom", "notadir"]
FAIL_ON = ["topk", "last"]
#: the kinds of bad checkpoint, and the type that Lightning 1.6.5 raised for each
BAD_CHECKPOINTS = [
    ("missing", "builtins.FileNotFoundError"),
    ("truncated", "builtins.RuntimeError"),
    ("random", "_pickle.UnpicklingError"),
    ("empty", "builtins.EOFError"),
    ("not_a_checkpoint", "builtins.TypeError"),
    ("wrong_keys", "builtins.RuntimeError"),
    ("rank1_only", "builtins.FileNotFoundError"),
]
#: the one case of the batch whose error ends the processes (see the module's docstring)
EXITING = "resume_bad-rank1_only"


class Faults(NamedTuple):
    batch: ScenarioBatch
    finished: float  # when the launch ended, i.e. every rank had exited


def run_faulty(name: str, out: Path, *args: str, timeout: float = 180) -> ScriptResult:
    result = launch(SCENARIOS, name, out, *args, timeout=timeout, grace=GRACE)
    assert not result.timed_out, f"timed out after {result.seconds:.0f}s; output:\n{result.output[-8000:]}"
    return result


@pytest.fixture(scope="module")
def faults(request, tmp_path_factory) -> Faults:
    """Queue the cases of the selected tests, and launch them once."""
    selected = selected_tests(request)
    batch = ScenarioBatch(SCENARIOS, tmp_path_factory.mktemp("faults"), timeout=BATCH_TIMEOUT, grace=GRACE)
    if "test_failed_save_stops_every_rank_and_keeps_previous_checkpoint" in selected:
        for error in SAVE_ERRORS:
            batch.add(f"save_fails-{error}", "save_fails", "--error", error, "--caught")
    if "test_failed_model_checkpoint_save_during_fit" in selected:
        for fail_on in FAIL_ON:
            batch.add(f"fit_checkpoint_fails-{fail_on}", "fit_checkpoint_fails", "--fail-on", fail_on, "--caught")
    if "test_resume_from_bad_checkpoint_fails_on_every_rank" in selected:
        good = batch.folder("save_good") / "good.ckpt"
        batch.add("save_good", "save_good", "--ckpt", good)
        for kind, _ in BAD_CHECKPOINTS:
            case = f"resume_bad-{kind}"
            ckpt = batch.folder(case) / f"{kind}.ckpt"
            args = ["--ckpt", ckpt, "--good", good, "--bad", "good" if kind == "rank1_only" else kind]
            if kind == "rank1_only":
                args += ["--fail-load-rank", "1"]
            batch.add(case, "resume_bad", *args, *([] if case == EXITING else ["--caught"]), fails=case == EXITING)
    batch.run()
    return Faults(batch, time.time())


def assert_every_rank_failed(faults: Faults, case: str, *fragments: str) -> List[str]:
    """Both ranks raised (their tracebacks name every fragment), within ``MAX_EXIT_SECONDS`` of the fault, and no rank
    finished the scenario; for :data:`EXITING`, the processes also exited within that time."""
    out = faults.batch.folder(case)
    fault_time = read_facts(out)["fault_time"]
    if case == EXITING:
        result = faults.batch.failure(case)
        assert not result.timed_out, f"timed out after {result.seconds:.0f}s; output:\n{result.output[-8000:]}"
        assert result.returncode != 0, f"rank 0 exited with 0; output:\n{result.output[-8000:]}"
        errors = []
        for rank in range(WORLD_SIZE):
            error = out / f"rank{rank}.error"
            assert error.exists(), f"rank {rank} did not raise; output:\n{result.output[-8000:]}"
            assert not (out / f"rank{rank}.json").exists(), f"rank {rank} carried on after the fault"
            errors.append(error.read_text())
        assert_quick(case, "every rank exited", faults.finished - fault_time, result.output)
    else:
        records = faults.batch.results(case)
        for rank, record in enumerate(records):
            assert "error" in record and not record.get("survived"), f"rank {rank} carried on after the fault"
        errors = [record["error"] for record in records]
        raised = max(record["raised_time"] for record in records) - fault_time
        assert_quick(case, "every rank raised", raised, "\n".join(errors))
    for rank, text in enumerate(errors):
        for fragment in fragments:
            assert fragment in text, f"rank {rank}'s error lacks {fragment!r}:\n{text}"
    return errors


def assert_quick(name: str, what: str, seconds: float, output: str) -> None:
    """``what`` happened within ``MAX_EXIT_SECONDS`` of the fault."""
    print(f"fault scenario {name}: {what} {seconds:.1f}s after the fault")
    # a rank that hangs is only killed GRACE seconds after rank 0 exits, which is more than the bound
    assert seconds < MAX_EXIT_SECONDS, f"{name}: {what} only {seconds:.0f}s after the fault:\n{output[-8000:]}"


def time_to_exit(name: str, out: Path, finished: float, result: ScriptResult) -> float:
    """Seconds from the fault (recorded by rank 0 just before it) to the exit of the last rank."""
    seconds = finished - read_facts(out)["fault_time"]
    assert_quick(name, f"every rank exited (whole run {result.seconds:.1f}s)", seconds, result.output)
    return seconds


def read_facts(out: Path) -> Dict:
    path = out / "facts.json"
    return json.loads(path.read_text()) if path.exists() else {}


def assert_every_rank_raised_type(out: Path, expected: str) -> None:
    """Every rank's error is both a ``CheckpointError`` and an ``expected`` (``module.qualname``), the type that
    Lightning 1.6.5 raised, so that the ``except`` clauses written for it still catch it on every rank."""
    for rank in range(WORLD_SIZE):
        types = json.loads((out / f"rank{rank}.types.json").read_text())
        assert "pytorch_lightning.utilities.exceptions.CheckpointError" in types["error"], (rank, types)
        assert expected in types["error"], (rank, types)


def hashes(folder: Path) -> Dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("error", SAVE_ERRORS)
def test_failed_save_stops_every_rank_and_keeps_previous_checkpoint(faults, error):
    """``trainer.save_checkpoint`` whose write fails on rank 0 (``OSError(ENOSPC)``, any exception of a custom
    ``CheckpointIO``, or a real ``OSError`` of the default ``TorchCheckpointIO`` when the directory cannot be created)
    raises on both ranks; the previous file at the same path is byte-identical."""
    case = f"save_fails-{error}"
    out = faults.batch.folder(case)
    path = str(out / "ckpts" / ("blocker/model.ckpt" if error == "notadir" else "model.ckpt"))
    cause = {
        "enospc": "No space left on device",
        "custom": "injected failure of a custom CheckpointIO",
        "notadir": "Error",  # FileExistsError or NotADirectoryError, depending on fsspec
    }[error]
    rank0, rank1 = assert_every_rank_failed(faults, case, "CheckpointError", path, cause)
    assert "failed on global rank 0" in rank1
    # rank 1 did not fail itself: it learns the type of rank 0's error by name
    assert_every_rank_raised_type(out, "builtins.RuntimeError" if error == "custom" else "builtins.OSError")
    facts = read_facts(out)
    assert facts["failed_path"] == path
    assert facts["before"] and hashes(out / "ckpts") == facts["before"]


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("fail_on", FAIL_ON)
def test_failed_model_checkpoint_save_during_fit(faults, fail_on):
    """A ``ModelCheckpoint`` save (top-k with pruning, or ``save_last``) that fails on rank 0 during ``fit`` stops
    both ranks; every checkpoint that existed before the failed save is still there, byte-identical (in particular
    the top-k file that the failed save would have replaced is not pruned)."""
    case = f"fit_checkpoint_fails-{fail_on}"
    out = faults.batch.folder(case)
    facts = read_facts(out)
    assert_every_rank_failed(faults, case, "CheckpointError", facts["failed_path"], "No space left on device")
    before = facts["before"]
    # the top 2 and last.ckpt existed before the failed save, and nothing was pruned or overwritten
    assert len(before) == 3 and "last.ckpt" in before, before
    assert hashes(out / "ckpts") == before


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("kind, original", BAD_CHECKPOINTS)
def test_resume_from_bad_checkpoint_fails_on_every_rank(faults, kind, original):
    """``fit(ckpt_path=...)`` from a bad file fails on both ranks with an error naming the path, quickly, and no rank
    trains on. ``rank1_only``: the file is good, but loading fails on global rank 1 only, so rank 0 alone would
    otherwise go on into FSDP's collectives and wait there for the process-group timeout. On every rank the error
    is also of the ``original`` type that Lightning 1.6.5 raised (e.g. ``FileNotFoundError`` for a missing file)."""
    case = f"resume_bad-{kind}"
    out = faults.batch.folder(case)
    fragments = ["CheckpointError", str(out / f"{kind}.ckpt")]
    if kind == "wrong_keys":
        fragments += ["Loading the model state", "Missing key(s)"]
    if kind == "rank1_only":
        fragments += ["failed on global rank 1"]
    assert_every_rank_failed(faults, case, *fragments)
    assert_every_rank_raised_type(out, original)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("previous", [True, False], ids=["previous", "no_previous"])
def test_killed_mid_save_leaves_no_truncated_file(tmp_path, previous):
    """``kill -9`` of rank 0 while it writes a large checkpoint: the previous file at the target path is intact, or
    there is no file at all if there was none before. Needs atomic checkpoint writes (temporary file + rename)."""
    result = run_faulty("killed_mid_save", tmp_path, "--megabytes", "256", *(["--previous"] if previous else []))
    finished = time.time()
    facts = read_facts(tmp_path)
    assert "killed_while" in facts, f"the write finished before rank 0 could be killed:\n{result.output[-8000:]}"
    assert result.returncode == -9, result.output[-8000:]
    time_to_exit(f"killed_mid_save[{'previous' if previous else 'no_previous'}]", tmp_path, finished, result)
    target = tmp_path / "ckpts" / "model.ckpt"
    if previous:
        assert hashes(tmp_path / "ckpts").get("model.ckpt") == facts["before"]["model.ckpt"], (
            f"{target} was not left as it was (killed while writing {facts['killed_while']}"
            f" at {facts['killed_at_size']} B)"
        )
    else:
        assert not target.exists(), (
            f"a partial {target} of {target.stat().st_size} B was left behind"
            f" (killed while writing {facts['killed_while']} at {facts['killed_at_size']} B)"
        )
    # the kill left the temporary file behind; the next save into the directory removes it
    debris = list((tmp_path / "ckpts").glob("model.ckpt.*.tmp"))
    assert len(debris) == 1, debris
    atomic_save({"next": 1}, tmp_path / "ckpts" / "next.ckpt")
    assert not list((tmp_path / "ckpts").glob("*.tmp"))
