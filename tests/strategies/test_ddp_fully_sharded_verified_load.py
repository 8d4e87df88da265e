"""The check of a checkpoint's CRC-32s on an FSDP resume (the fork/verified-checkpoints patch) on 2 CPU ranks, with
real FairScale FSDP over gloo (see fsdp_harness/cpu_fsdp.py) and the strategy's default ``checkpoint_writers``.

A file saved once is damaged by one flipped bit in a record read by rank 0 only, by rank 1 only, by both ranks
(FSDP flat-parameter pieces, whose CRC-32 the ranks combine), in an optimizer flat state, in a tied name's own record
(each rank checks half), outside FSDP, or in a float of the pickle: every rank raises a ``CheckpointError`` naming the
record, before any training or validation batch. Which ranks read which record is worked out from the shard ranges
and checked against the reads the load reports. The good file, a file without tensor CRC-32s (earlier fork
revisions) and a damaged one with ``PL_CHECKPOINT_VERIFY=0`` resume; a truncated one raises the loader's
``CheckpointError``. A weight that is a view of a larger storage, whose pieces do not cover its record, raises too;
tensors that ``on_load_checkpoint`` edits in place do not.
Every case runs in ONE launch of the 2 ranks (:class:`~fsdp_harness.runner.ScenarioBatches`, cases in
``fsdp_verified_load_scenarios.py``), about 10-25 s.
"""
from typing import Any, Dict, List

import pytest

from fsdp_harness.runner import CasePlans, ScenarioBatches
from tests.strategies.fsdp_verified_load_scenarios import FLIPS, RESUMED_STEPS, SAVED_STEPS, VIEW, VIEW_KEY

SCENARIOS = "tests.strategies.fsdp_verified_load_scenarios"
BATCH_TIMEOUT = 120
TIMEOUT = BATCH_TIMEOUT + 30

plans = CasePlans()


def _save(batches: ScenarioBatches) -> None:
    if "save" not in batches.batch("two", 2):
        batches.batch("two", 2).add("save", "save")


def _resume(batches: ScenarioBatches, case: str, ckpt: str, *options: str) -> None:
    _save(batches)
    batch = batches.batch("two", 2)
    if case not in batch:
        batch.add(case, "resume", "--ckpt", batch.folder("save") / f"{ckpt}.ckpt", *options)


def _plan_flips(batches: ScenarioBatches) -> None:
    for name in FLIPS:
        _resume(batches, f"flip-{name}", name)


def _plan_good(batches: ScenarioBatches) -> None:
    _resume(batches, "good", "good", "--record-reads")


def _plan_truncated(batches: ScenarioBatches) -> None:
    _resume(batches, "truncated", "truncated")


def _plan_previous(batches: ScenarioBatches) -> None:
    _resume(batches, "previous_revision", "previous_revision")


def _plan_off(batches: ScenarioBatches) -> None:
    _resume(batches, "verify_off", "rank0_only", "--verify", "0")


def _plan_view(batches: ScenarioBatches) -> None:
    _resume(batches, VIEW, VIEW)


#: tensors ``on_load_checkpoint`` edits in place: one the ranks read in parts, one each rank reads whole
EDITED = "normed.1.weight,before"


#: the damaged files resumed with rank 1 unchecked: records read in parts by rank 1 only, and by both ranks
UNCHECKED_RANK_FLIPS = ("rank1_only", "both_ranks", "optimizer_flat")


def _plan_unchecked_rank(batches: ScenarioBatches) -> None:
    for name in UNCHECKED_RANK_FLIPS:
        _resume(batches, f"rank1_unchecked-{name}", name, "--unchecked-rank", "1")


def _plan_edited(batches: ScenarioBatches) -> None:
    _resume(batches, "edited_in_place", "good", "--edit-in-place", EDITED)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> ScenarioBatches:
    return plans.queued_batches(request, SCENARIOS, tmp_path_factory.mktemp("verified"), {"two": (2, BATCH_TIMEOUT)})


def _saved(runs: ScenarioBatches) -> Dict[str, Any]:
    rank0, rank1 = runs.results("save")
    assert rank0["global_step"] == SAVED_STEPS
    assert rank0["checkpoint_writers"] == "auto"
    assert rank0["readers"] == rank1["readers"]
    return rank0


def _assert_resumed(results: List[Dict[str, Any]]) -> None:
    for result in results:
        assert result["error"] is None, result
        assert result["global_step"] == RESUMED_STEPS, result
        assert result["train_batches"] == RESUMED_STEPS - SAVED_STEPS, result


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_good)
def test_flipped_records_are_read_by_the_ranks_named(runs):
    """Which ranks read the records the other tests flip, worked out from the flat parameters' shard ranges, and as
    the load reports its reads (``_note_read``, recorded on the good file): the LayerNorm's weight by rank 0 only, the
    Linear's bias by rank 1 only, its weight and the unit's optimizer flat state by both; the tied name's own record,
    the parameter outside FSDP and the pickle by neither in parts (each rank checks its share of the first, and the
    others whole). Every record the load reads in parts is one of the checkpoint's."""
    saved = _saved(runs)
    reads = [set(result["reads"]) for result in runs.results("good")]
    for name, (key, _, ranks) in FLIPS.items():
        record = saved["flipped"][name]["record"]
        if key is not None:
            assert saved["record_keys"][key] == record
        if key is not None and key.startswith("state_dict."):
            assert saved["readers"].get(key, []) == ranks, (name, saved["readers"])
        assert [rank for rank in (0, 1) if record in reads[rank]] == ranks, (name, record, reads)
    assert not any(record.startswith("<") for rank_reads in reads for record in rank_reads), reads
    # the tied name's own record: each rank checks its share
    tied = saved["flipped"]["tied_share"]["record"]
    assert all(f"share:{tied}" in rank_reads for rank_reads in reads), reads


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", list(FLIPS))
@plans.queues(_plan_flips)
def test_flipped_bit_raises_on_every_rank_before_any_step(runs, name):
    """One flipped bit in a record read by rank 0 only, by rank 1 only, by both, in an optimizer flat state, in a tied
    name's own record, outside FSDP, or in a float of the pickle (which still unpickles): every rank raises a
    ``CheckpointError`` that names the file, the record, its byte range (holding the flipped byte) and its keys, and
    says it is corrupt; no training or validation batch started, and the step is the saved one."""
    saved = _saved(runs)
    flipped = saved["flipped"][name]
    record, byte = flipped["record"], flipped["byte"]
    key = FLIPS[name][0]
    for result in runs.results(f"flip-{name}"):
        error = result["error"]
        assert error is not None, f"rank {result['rank']} raised nothing: {result}"
        assert "CheckpointError" in result["error_types"]
        assert f"{name}.ckpt' is corrupt: its record {record!r} (bytes " in error, error
        start, end = (int(n) for n in error.split(f"{record!r} (bytes ")[1].split(" of the file")[0].split(" to "))
        assert start <= byte < end, (byte, error)
        assert (f"'{key}'" if key else "holding no tensor of the checkpoint") in error, error
        assert (result["train_batches"], result["validation_batches"]) == (0, 0), result
        assert result["global_step"] == SAVED_STEPS, result


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_good)
def test_good_file_resumes_checked(runs):
    """The file as saved resumes on both ranks and trains on, and no rank says it is loaded unchecked."""
    results = runs.results("good")
    _assert_resumed(results)
    assert [result["unchecked"] for result in results] == [[], []]


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_edited)
def test_tensors_edited_in_place_on_load_are_not_called_corrupt(runs):
    """A LightningModule whose ``on_load_checkpoint`` adds 1 in place to a tensor the ranks read in parts and to one
    each reads whole: the bytes the load reads (over the memory-mapped file, whose edited pages are the process's own)
    do not match their CRC-32s, the records are read again from the file, which does, and both ranks resume."""
    _assert_resumed(runs.results("edited_in_place"))


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_unchecked_rank)
@pytest.mark.parametrize("name", UNCHECKED_RANK_FLIPS)
def test_rank_without_a_check_leaves_no_record_unread(runs, name):
    """Rank 1 loads without a check of its own (``PL_CHECKPOINT_VERIFY=0`` there only, as where a rank cannot check
    the file): rank 0's pieces alone do not cover the records read in parts, so it reads every one of them again from
    the file itself (before, it read every other one, leaving rank 1's share unread), and both ranks raise."""
    record = _saved(runs)["flipped"][name]["record"]
    for result in runs.results(f"rank1_unchecked-{name}"):
        assert result["error"] is not None, f"rank {result['rank']} resumed from the damaged file: {result}"
        assert f"is corrupt: its record {record!r}" in result["error"], result["error"]
        assert result["train_batches"] == 0, result


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_truncated)
def test_truncated_file_raises_the_loaders_checkpoint_error(runs):
    """A truncated file cannot be loaded: every rank raises the loader's ``CheckpointError`` naming the file (as
    before the check)."""
    path = str(runs.folder("save") / "truncated.ckpt")
    for result in runs.results("truncated"):
        assert "CheckpointError" in result["error_types"], result
        assert result["error"].startswith(f"Loading the checkpoint from {path!r} failed on global rank "), result
        assert "It may be truncated, corrupted or missing." in result["error"], result
        assert result["train_batches"] == 0, result


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_previous)
def test_file_of_the_previous_revision_resumes_unchecked(runs):
    """A file whose tensor records carry no CRC-32 (every one 0, the pickle's set: the streamed and parallel saves of
    earlier fork revisions) resumes, and global rank 0 says once that it is loaded unchecked, and why."""
    saved = _saved(runs)
    assert len(saved["zeroed"]) >= 20
    results = runs.results("previous_revision")
    _assert_resumed(results)
    rank0, rank1 = (result["unchecked"] for result in results)
    assert len(rank0) == 1 and "previous_revision.ckpt" in rank0[0], rank0
    assert "its tensor records carry no CRC-32" in rank0[0], rank0
    assert rank1 == []


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_off)
def test_check_off_resumes_a_flipped_file(runs):
    """``PL_CHECKPOINT_VERIFY=0`` turns the check off: the file with a flipped bit in a record read by rank 0 only
    resumes on both ranks, silently (the damaged weight is loaded as it is)."""
    results = runs.results("verify_off")
    _assert_resumed(results)
    assert [result["unchecked"] for result in results] == [[], []]


@pytest.mark.timeout(TIMEOUT)
@plans.queues(_plan_view)
def test_flipped_bit_in_a_view_of_a_larger_storage_raises(runs):
    """A checkpoint whose weight is a view of the first elements of a larger tensor (a weight trimmed by user code,
    ``w[:n]``, before ``torch.save``, which writes the whole storage), with one bit flipped in the weight's own bytes:
    ``zipfile`` finds the record damaged, and the resume raises on every rank as for any other FSDP piece. The ranks'
    pieces do not cover the record, which one rank then checks whole (before the fix the record went unchecked)."""
    view = _saved(runs)["view"]
    record = view["record"]
    # the flipped bit is in the record, which holds more than the weight's 32 x 32 floats
    assert view["damaged"] == record and view["size"] > 4 * 32 * 32, view
    for result in runs.results(VIEW):
        assert result["error"] is not None, f"rank {result['rank']} resumed from the damaged file: {result}"
        assert f"is corrupt: its record {record!r}" in result["error"] and f"'{VIEW_KEY}'" in result["error"]
        assert result["train_batches"] == 0, result
