"""Checkpointing under faults with DDPFullyShardedStrategy on 2 CPU processes (see fsdp_harness/cpu_fsdp.py).

A failed checkpoint write on rank 0 and a bad checkpoint on resume must stop every rank within seconds with an
error naming the file, without relying on process-group timeouts, and must never cost the last good checkpoint.
Every scenario is bounded: ``run_module`` kills all ranks at ``timeout``, and the ranks other than rank 0 get
``GRACE`` seconds after rank 0 exits, so a rank that hangs makes the time-to-exit exceed ``MAX_EXIT_SECONDS``.

Each test prints ``fault scenario <name>: time-to-exit <s>`` (run pytest with ``-s`` to see it).
"""
import hashlib
import json
import time
from pathlib import Path
from typing import Dict, List

import pytest

from fsdp_harness.corrupt_checkpoint import make_bad_checkpoint
from fsdp_harness.multiprocess import ScriptResult
from fsdp_harness.runner import launch, run_scenario
from pytorch_lightning.utilities.cloud_io import atomic_save

SCENARIOS = "tests.strategies.fsdp_fault_scenarios"
MAX_EXIT_SECONDS = 60
GRACE = MAX_EXIT_SECONDS + 5
WORLD_SIZE = 2


def run_faulty(name: str, out: Path, *args: str, timeout: float = 180) -> ScriptResult:
    result = launch(SCENARIOS, name, out, *args, timeout=timeout, grace=GRACE)
    assert not result.timed_out, f"timed out after {result.seconds:.0f}s; output:\n{result.output[-8000:]}"
    return result


def assert_every_rank_failed(out: Path, result: ScriptResult, *fragments: str) -> List[str]:
    """Both ranks raised (their tracebacks name every fragment) and no rank finished the scenario."""
    assert result.returncode != 0, f"rank 0 exited with 0; output:\n{result.output[-8000:]}"
    errors = []
    for rank in range(WORLD_SIZE):
        error = out / f"rank{rank}.error"
        assert error.exists(), f"rank {rank} did not raise; output:\n{result.output[-8000:]}"
        assert not (out / f"rank{rank}.json").exists(), f"rank {rank} carried on after the fault"
        text = error.read_text()
        for fragment in fragments:
            assert fragment in text, f"rank {rank}'s error lacks {fragment!r}:\n{text}"
        errors.append(text)
    return errors


def time_to_exit(name: str, out: Path, finished: float, result: ScriptResult) -> float:
    """Seconds from the fault (recorded by rank 0 just before it) to the exit of the last rank."""
    facts = read_facts(out)
    seconds = finished - facts["fault_time"]
    errors = [out / f"rank{rank}.error" for rank in range(WORLD_SIZE)]
    raised = max(p.stat().st_mtime for p in errors if p.exists()) - facts["fault_time"] if any(
        p.exists() for p in errors
    ) else float("nan")
    print(
        f"fault scenario {name}: time-to-exit {seconds:.1f}s, last rank raised after {raised:.3f}s"
        f" (whole run {result.seconds:.1f}s)"
    )
    # a rank that hangs is only killed GRACE seconds after rank 0 exits, which is more than the bound
    assert seconds < MAX_EXIT_SECONDS, f"{name}: ranks took {seconds:.0f}s to exit:\n{result.output[-8000:]}"
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("error", ["enospc", "custom", "notadir"])
def test_failed_save_stops_every_rank_and_keeps_previous_checkpoint(tmp_path, error):
    """``trainer.save_checkpoint`` whose write fails on rank 0 (``OSError(ENOSPC)``, any exception of a custom
    ``CheckpointIO``, or a real ``OSError`` of the default ``TorchCheckpointIO`` when the directory cannot be created)
    raises on both ranks; the previous file at the same path is byte-identical."""
    result = run_faulty("save_fails", tmp_path, "--error", error)
    finished = time.time()
    path = str(tmp_path / "ckpts" / ("blocker/model.ckpt" if error == "notadir" else "model.ckpt"))
    cause = {
        "enospc": "No space left on device",
        "custom": "injected failure of a custom CheckpointIO",
        "notadir": "Error",  # FileExistsError or NotADirectoryError, depending on fsspec
    }[error]
    rank0, rank1 = assert_every_rank_failed(tmp_path, result, "CheckpointError", path, cause)
    assert "failed on global rank 0" in rank1
    # rank 1 did not fail itself: it learns the type of rank 0's error by name
    assert_every_rank_raised_type(tmp_path, "builtins.RuntimeError" if error == "custom" else "builtins.OSError")
    time_to_exit(f"save_fails[{error}]", tmp_path, finished, result)
    facts = read_facts(tmp_path)
    assert facts["failed_path"] == path
    assert facts["before"] and hashes(tmp_path / "ckpts") == facts["before"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fail_on", ["topk", "last"])
def test_failed_model_checkpoint_save_during_fit(tmp_path, fail_on):
    """A ``ModelCheckpoint`` save (top-k with pruning, or ``save_last``) that fails on rank 0 during ``fit`` stops
    both ranks; every checkpoint that existed before the failed save is still there, byte-identical (in particular
    the top-k file that the failed save would have replaced is not pruned)."""
    result = run_faulty("fit_checkpoint_fails", tmp_path, "--fail-on", fail_on)
    finished = time.time()
    facts = read_facts(tmp_path)
    assert_every_rank_failed(tmp_path, result, "CheckpointError", facts["failed_path"], "No space left on device")
    time_to_exit(f"fit_checkpoint_fails[{fail_on}]", tmp_path, finished, result)
    before = facts["before"]
    # the top 2 and last.ckpt existed before the failed save, and nothing was pruned or overwritten
    assert len(before) == 3 and "last.ckpt" in before, before
    assert hashes(tmp_path / "ckpts") == before


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good")
    ckpt = out / "good.ckpt"
    run_scenario(SCENARIOS, "save_good", out, "--ckpt", ckpt, timeout=180)
    return ckpt


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind, original",
    [
        ("missing", "builtins.FileNotFoundError"),
        ("truncated", "builtins.RuntimeError"),
        ("random", "_pickle.UnpicklingError"),
        ("empty", "builtins.EOFError"),
        ("not_a_checkpoint", "builtins.TypeError"),
        ("wrong_keys", "builtins.RuntimeError"),
        ("rank1_only", "builtins.FileNotFoundError"),
    ],
)
def test_resume_from_bad_checkpoint_fails_on_every_rank(tmp_path, good_checkpoint, kind, original):
    """``fit(ckpt_path=...)`` from a bad file fails on both ranks with an error naming the path, quickly, and no rank
    trains on. ``rank1_only``: the file is good, but loading fails on global rank 1 only, so rank 0 alone would
    otherwise go on into FSDP's collectives and wait there for the process-group timeout. On every rank the error
    is also of the ``original`` type that Lightning 1.6.5 raised (e.g. ``FileNotFoundError`` for a missing file)."""
    ckpt = tmp_path / f"{kind}.ckpt"
    args = ["--ckpt", str(ckpt)]
    if kind == "rank1_only":
        ckpt.write_bytes(good_checkpoint.read_bytes())
        args += ["--fail-load-rank", "1"]
    else:
        make_bad_checkpoint(kind, good_checkpoint, ckpt)
    result = run_faulty("resume_bad", tmp_path, *args)
    finished = time.time()
    fragments = ["CheckpointError", str(ckpt)]
    if kind == "wrong_keys":
        fragments += ["Loading the model state", "Missing key(s)"]
    if kind == "rank1_only":
        fragments += ["failed on global rank 1"]
    assert_every_rank_failed(tmp_path, result, *fragments)
    assert_every_rank_raised_type(tmp_path, original)
    time_to_exit(f"resume_bad[{kind}]", tmp_path, finished, result)


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
