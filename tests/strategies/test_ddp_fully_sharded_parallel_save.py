"""The parallel FSDP save (``DDPFullyShardedStrategy(checkpoint_writers="all")``): global rank 0 writes the streamed
save's structure, then every rank writes its own shards into the same file.

The file must be the one the gathered save writes (``stream_checkpoint=False``), tensor by tensor, with SGD momentum
and Adam, tied weights, parameters outside FSDP, and shards that end inside tensors and inside 4 KiB blocks; the
ranks' writes must fall into disjoint blocks and cover every FSDP byte; the file resumes exactly on 2 ranks and on 1,
and one written on 1 rank resumes on 2; a full disk, a file that cannot be opened or an allocation that fails on rank
1 raises on every rank and keeps the previous file, and so do a rank 1 that stalls in its writes past
``PL_CHECKPOINT_TIMEOUT`` and one killed in them (also in the background) or while rank 0 writes the structure.
With ``async_checkpoint=True`` saves in
the background write every rank's own shards from their writer threads and gather nothing; a full disk there raises
as above. The default (``"auto"``) writes as ``"all"`` on 2 ranks sharing the directory and as ``"rank0"`` in one
process. Scenarios in ``fsdp_parallel_save_scenarios.py`` run real FairScale FSDP on CPU processes over gloo, in
five batches of one driver (2 ranks, 1, 2 again three times), each of the 2-rank ones ending with a case that kills
rank 1.
"""
import json
import subprocess
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from fsdp_harness.runner import ScenarioBatches
from pytorch_lightning.strategies.fsdp_parallel_save import _checked_checkpoint_writers
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from tests.helpers.loop_mount import loop_mount_unavailable, mounted_ext4
from tests.helpers.runif import RunIf

SCENARIOS = "tests.strategies.fsdp_parallel_save_scenarios"
WRITERS = "all"
BLOCK = 4096
# model, wrapping, optimizer, width: at width 72 a weight spans several blocks and a shard ends inside it
EQUALS = [("tied", "wrap", "sgd", 72), ("plain", "auto_wrap", "adam", 16), ("tied", "wrap", "adam", 72)]
# saved in the background (``async_checkpoint=True``): SGD momentum and Adam, parameters inside and outside FSDP
ASYNC_EQUALS = [EQUALS[0], EQUALS[2]]
# "later": 2 ranks again, after "one", to resume a file written on 1 rank; then rank 1 is killed; "exchange" and
# "structure": rank 1 killed in other places (each 2-rank batch ends with a case that kills rank 1)
BATCHES = {"two": (2, 420), "one": (1, 180), "later": (2, 180), "exchange": (2, 120), "structure": (2, 120)}
#: ``PL_CHECKPOINT_TIMEOUT`` of the "later" batch: the killed rank must be named long before it
KILLED_TIMEOUT = 30
BATCHES_TIMEOUT = sum(timeout for _, timeout in BATCHES.values()) + 60
FAULTS = [
    ("full_disk", "No space left on device"), ("cannot_open", "No such file"),
    ("no_memory", "can't allocate memory"),
]
#: the faults' scenarios, each with what every rank raises: saves in the foreground, and in the background
FAULT_SCENARIOS = {
    "fails_while_writing": "failed on global rank 1: ",
    "async_fails_while_writing": "in the background failed on global rank 1: ",
}
#: ``PL_CHECKPOINT_TIMEOUT`` of the slow rank's case, and how long rank 1 stalls in a write there
SLOW_TIMEOUT, SLOW_STALL = 2, 5
#: the loop-mounted ext4 filesystems (MiB, ``mkfs.ext4 -O`` features): at width 600 a checkpoint is about 8.3 MiB
#: (3 units, SGD momentum), so "full" (about 13 MiB free) holds one but not a second beside it
SMALL_FILESYSTEMS = {"full": (16, ()), "no_fallocate": (64, ("^extent", "^64bit"))}
FILESYSTEM_WIDTH = 600
#: why the loop mounts failed, where they did
UNMOUNTABLE: List[str] = []
#: the fixed costs of one parallel save on each of 2 ranks (``save_costs``): one read of its mount table; the flag
#: exchanges of the ranks' arrival, of ``Trainer.save_checkpoint``'s agreement after the dump, of the agreement before
#: the block exchange, of the writes' settlement and of ``Trainer.save_checkpoint``'s final exchange; the object
#: collectives of the stream decision, of rank 0's structure decision with its plan, and of the writers' probe
#: results
#: the object collectives: revision 110's three and, since revision 111, the gather of the pieces' CRC-32s to rank 0
SAVE_COSTS = {"mount_table_reads": 1, "flag_exchanges": 5, "object_collectives": 4}


def _case(model: str, wrapping: str, optimizer: str, width: int) -> str:
    return f"equals-{model}-{wrapping}-{optimizer}-{width}"


def _options(model: str, wrapping: str, optimizer: str, width: int) -> List[str]:
    options = ["--model", model, "--wrapping", wrapping, "--optimizer", optimizer, "--width", width]
    return [str(option) for option in options] + ["--writers", WRITERS]


@pytest.fixture(scope="module")
def small_filesystems(tmp_path_factory) -> Iterator[Dict[str, Path]]:
    """Real ext4 filesystems on loop devices for the parallel save's preallocation (none where they cannot be
    mounted here): "full", too small for a second checkpoint beside the first; "no_fallocate", without extents, so
    that ``fallocate`` fails with ``EOPNOTSUPP``."""
    if loop_mount_unavailable() is not None:
        yield {}
        return
    with ExitStack() as stack:
        try:
            mounts = {
                name: stack.enter_context(mounted_ext4(tmp_path_factory.mktemp(name), size_mb, features))
                for name, (size_mb, features) in SMALL_FILESYSTEMS.items()
            }
        except subprocess.CalledProcessError as ex:  # no free loop device, or no right to mount one
            UNMOUNTABLE.append(f"{' '.join(ex.cmd[:3])} failed: {ex.stderr!r}")
            mounts = {}
        yield mounts


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory, small_filesystems) -> ScenarioBatches:
    batches = ScenarioBatches(SCENARIOS, tmp_path_factory.mktemp("parallel"))
    for name, (devices, timeout) in BATCHES.items():
        env = {"PL_CHECKPOINT_TIMEOUT": str(KILLED_TIMEOUT)} if name in ("later", "exchange", "structure") else None
        batches.batch(name, devices, timeout, env)
    for case in EQUALS:
        batches.batch("two", 2).add(_case(*case), "parallel_equals_gathered", *_options(*case))
    saved = batches.batch("two", 2).folder(_case(*EQUALS[2])) / "parallel.ckpt"
    for name, devices in (("two", 2), ("one", 1)):
        batches.batch(name, devices).add(f"resume-2-{devices}", "resume", *_options(*EQUALS[2]), "--ckpt", saved)
    # written by the one rank of a single process, through the same parallel path, and resumed on 2 ranks
    one = batches.batch("one", 1).add(f"one-{_case(*EQUALS[2])}", "parallel_equals_gathered", *_options(*EQUALS[2]))
    batches.batch("later", 2).add("resume-1-2", "resume", *_options(*EQUALS[2]), "--ckpt", one / "parallel.ckpt")
    batches.batch("later", 2).add("killed", "killed_while_writing", "--writers", WRITERS, "--width", 72, fails=True)
    for place in ("exchange", "structure"):
        batches.batch(place, 2).add(
            f"killed_in_{place}", "killed_while_writing", "--writers", WRITERS, "--width", 72, "--killed-in", place,
            fails=True,
        )
    # the strategy's default checkpoint_writers, on a directory every rank shares, and in a single process
    default = ["--model", "tied", "--width", "72", "--writers", "default"]
    for name, devices in (("two", 2), ("one", 1)):
        batches.batch(name, devices).add(f"default-{devices}", "default_writers", *default)
    for case in ASYNC_EQUALS:
        batches.batch("two", 2).add(f"async-{_case(*case)}", "async_equals_gathered", *_options(*case))
    # wide enough that rank 1 owns blocks: narrower, it may only send its bytes to rank 0
    for scenario in FAULT_SCENARIOS:
        batches.batch("two", 2).add(scenario, scenario, "--writers", WRITERS, "--width", 72)
    slow = ["--timeout", SLOW_TIMEOUT, "--stall", SLOW_STALL]
    batches.batch("two", 2).add("slow_writer", "slow_writer", "--writers", WRITERS, "--width", 72, *slow)
    batches.batch("two", 2).add("save_costs", "save_costs", "--writers", WRITERS, "--width", 72)
    for name, folder in small_filesystems.items():
        options = ["--writers", WRITERS, "--width", FILESYSTEM_WIDTH, "--ckpt-dir", folder]
        batches.batch("two", 2).add(f"filesystem-{name}", "saves_on_filesystem", *options)
    # rank 1 is gone after it: the last case of its batch
    killed = ["--writers", WRITERS, "--width", 72, "--timeout", KILLED_TIMEOUT]
    batches.batch("two", 2).add("async_killed", "async_killed_while_writing", *killed, fails=True)
    return batches


def _blocks(ranges: List[Tuple[int, int]]) -> set:
    return {block for offset, size in ranges for block in range(offset // BLOCK, (offset + size - 1) // BLOCK + 1)}


def _covered(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """``ranges`` merged where they touch."""
    merged: List[List[int]] = []
    for offset, size in sorted(ranges):
        if merged and offset <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + size)
        else:
            merged.append([offset, offset + size])
    return [(lo, hi) for lo, hi in merged]


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("model", "wrapping", "optimizer", "width"), EQUALS)
def test_parallel_checkpoint_equals_gathered_checkpoint(parallel_runs, model, wrapping, optimizer, width):
    _check_equals_gathered(parallel_runs.results(_case(model, wrapping, optimizer, width)))


def _check_equals_gathered(results) -> None:
    rank0 = results[0]
    assert rank0["differences"] == []
    assert rank0["tensors"] >= 20  # model and optimizer state, all compared
    assert rank0["temporary_files"] == []


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.timeout(600)
def test_parallel_checkpoint_multi_gpu(tmp_path):
    """The bodies of ``test_parallel_checkpoint_equals_gathered_checkpoint[tied-wrap-adam-72]``,
    ``test_ranks_write_disjoint_blocks_covering_every_fsdp_byte`` and ``test_resume_from_parallel_checkpoint[2-2]`` on
    GPUs (2 ranks, NCCL; every rank writes its shards through its pinned staging buffer)."""
    batches = ScenarioBatches(SCENARIOS, tmp_path)
    batch = batches.batch("two", 2, BATCHES["two"][1])
    options = [*_options(*EQUALS[2]), "--accelerator", "gpu"]
    saved = batch.add("equals", "parallel_equals_gathered", *options) / "parallel.ckpt"
    batch.add("resume", "resume", *options, "--ckpt", saved)
    results = batches.results("equals")
    _check_equals_gathered(results)
    _check_disjoint_blocks_covering_every_fsdp_byte(results)
    assert batches.results("resume")[0]["differences"] == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("model", "wrapping", "optimizer", "width"), EQUALS)
def test_ranks_write_disjoint_blocks_covering_every_fsdp_byte(parallel_runs, model, wrapping, optimizer, width):
    """Every rank's ``pwrite``s after the structure: no block of 4 KiB is written by two ranks; together the writes
    are exactly the FSDP records, each byte once."""
    _check_disjoint_blocks_covering_every_fsdp_byte(parallel_runs.results(_case(model, wrapping, optimizer, width)))


def _check_disjoint_blocks_covering_every_fsdp_byte(results) -> None:
    records = results[0]["records"]
    writes = [[tuple(w) for w in result["writes"]] for result in results]
    assert all(writes), "every rank writes"
    assert not _blocks(writes[0]) & _blocks(writes[1])
    every = [w for rank_writes in writes for w in rank_writes]
    assert _covered(every) == _covered([tuple(r) for r in records])
    assert sum(size for _, size in every) == sum(size for _, size in records)  # no byte written twice


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("model", "wrapping", "optimizer", "width"), ASYNC_EQUALS)
def test_async_parallel_checkpoint_equals_gathered_checkpoint(parallel_runs, model, wrapping, optimizer, width):
    """With ``async_checkpoint=True`` a save inside ``fit`` goes to the background, and every rank's writer thread
    writes its own share of the file (about S / 2 each, disjoint blocks, every FSDP byte once) without gathering
    any unit; the file equals a gathered save, and ``ModelCheckpoint``'s saves in the background keep its files."""
    results = parallel_runs.results(f"async-{_case(model, wrapping, optimizer, width)}")
    zero = results[0]
    assert zero["differences"] == []
    assert zero["tensors"] >= 20
    assert zero["temporary_files"] == []
    assert list(zero["model_checkpoint"].values()) == [1, 1], zero["model_checkpoint"]  # top-1 and last, epoch 1
    for result in results:
        assert result["in_flight"] is True, "the save was not in the background"
        assert (result["threads"], result["gathers"]) == (["pl-async-checkpoint"], 0), result
    _check_disjoint_blocks_covering_every_fsdp_byte(results)
    total = sum(size for _, size in zero["records"])
    for result in results:
        assert 0.3 * total <= sum(size for _, size in result["writes"]) <= 0.7 * total, (result["rank"], total)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("saved", "resumed"), [(2, 2), (2, 1), (1, 2)])
def test_resume_from_parallel_checkpoint(parallel_runs, saved, resumed):
    """A file written by every rank resumes exactly at 2 -> 2, 2 -> 1 and 1 -> 2 ranks: saved again, it equals
    what was loaded; the one-rank file is also the gathered save's, tensor by tensor."""
    if saved == 1:
        written = parallel_runs.results(f"one-{_case(*EQUALS[2])}")[0]
        assert written["differences"] == [] and written["tensors"] >= 20 and written["writes"], written
    rank0 = parallel_runs.results(f"resume-{saved}-{resumed}")[0]
    assert rank0["differences"] == []
    assert rank0["tensors"] >= 20


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("devices", [2, 1])
def test_default_writers(parallel_runs, devices):
    """The default is ``checkpoint_writers="auto"``: on 2 ranks sharing the directory, global rank 0 writes one probe
    file and every rank its own shards, silently; a single process writes as ``"rank0"`` does, with no probe. The
    file equals a gathered save either way."""
    results = parallel_runs.results(f"default-{devices}")
    assert results[0]["differences"] == [] and results[0]["tensors"] >= 20
    assert results[0]["temporary_files"] == []
    for result in results:
        assert result["checkpoint_writers"] == "auto" and result["info"] == [], result
    writers = [(result["parallel_writer"], result["probes"]) for result in results]
    if devices == 2:
        assert writers == [(1, 1), (1, 0)], writers
        _check_disjoint_blocks_covering_every_fsdp_byte(results)
    else:
        assert writers == [(0, 0)], writers


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("scenario", list(FAULT_SCENARIOS))
@pytest.mark.parametrize(("fault", "cause"), FAULTS)
def test_failure_on_one_rank_keeps_the_previous_checkpoint(parallel_runs, scenario, fault, cause):
    """Rank 1's ``pwrite`` fails with ENOSPC, rank 1 cannot open the temporary file (ENOENT), or rank 1 cannot
    allocate its buffers of the block-boundary exchange (out of memory, so it is not a rank lost in the exchange):
    every rank raises a ``CheckpointError`` naming rank 1 and its error (in the background: at
    ``wait_for_checkpoint``), the previous file is untouched, no temporary file is left, and the next save works."""
    results = parallel_runs.results(scenario)
    for result in results:
        assert all(result.get("in_background", [True])), result
        assert FAULT_SCENARIOS[scenario] in (result[f"raised-{fault}"] or ""), result
        assert cause in result[f"raised-{fault}"]
    assert results[0][f"unchanged-{fault}"] is True
    assert results[0][f"temporary_files-{fault}"] == []
    assert results[0]["after_loads"] >= 8


def _fault_time(out: Path, name: str = "fault_time") -> float:
    return float((out / name).read_text())


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_slow_rank_fails_the_save_within_the_checkpoint_timeout(parallel_runs):
    """Rank 1 stalls in its ``pwrite`` of a shard longer than ``PL_CHECKPOINT_TIMEOUT`` (2 s here): rank 0 raises a
    ``CheckpointError`` naming rank 1 about that long after, not after gloo's or NCCL's default timeout and without
    waiting for rank 1; rank 1 raises the same as soon as its write returns; the previous file is untouched, no
    temporary file is left, and after a new ``Trainer`` stage the next save works."""
    rank0, rank1 = parallel_runs.results("slow_writer")
    out = parallel_runs.folder("slow_writer")
    stalled, resumed = _fault_time(out), _fault_time(out, "resumed_time")
    for result in (rank0, rank1):
        assert "failed on global rank 1: it did not reach the ranks' next exchange" in (result["raised"] or ""), result
        assert f"`PL_CHECKPOINT_TIMEOUT` ({SLOW_TIMEOUT} s)" in result["raised"]
    assert rank0["raised_time"] < resumed, "rank 0 waited for rank 1"
    assert rank0["raised_time"] - stalled < SLOW_TIMEOUT + 4
    assert rank1["raised_time"] - resumed < SLOW_TIMEOUT, "rank 1 waited for another timeout"
    assert rank0["unchanged"] is True and rank0["temporary_files"] == []
    assert rank0["after_loads"] >= 8


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("case", ["killed", "killed_in_exchange"])
def test_rank_killed_while_writing_its_shards(parallel_runs, case):
    """Rank 1 is killed (SIGKILL) in its ``pwrite`` of a shard of a save over a previous checkpoint, or in the
    exchange of the block-boundary bytes before it: rank 0 raises a ``CheckpointError`` naming rank 1 within seconds
    (gloo sees the closed connection; ``PL_CHECKPOINT_TIMEOUT`` is 30 s here), the previous file is untouched, and
    rank 0 removes the temporary file. Each is the last case of its batch: rank 1 is gone after it."""
    result, out = parallel_runs.failure(case), parallel_runs.folder(case)
    assert not result.timed_out, result.output[-8000:]
    assert result.returncode == 0, f"rank 0 did not finish:\n{result.output[-8000:]}"
    assert not (out / "rank1.json").exists(), "rank 1 was not killed"
    rank0 = json.loads((out / "rank0.json").read_text())
    assert "failed on global rank 1: it did not reach the ranks' next exchange" in (rank0["raised"] or ""), rank0
    assert f"`PL_CHECKPOINT_TIMEOUT` ({KILLED_TIMEOUT} s)" in rank0["raised"]
    assert rank0["raised_time"] - _fault_time(out) < 10
    assert rank0["unchanged"] is True
    assert rank0["temporary_files"] == [] and not list(out.glob("*.tmp"))


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_rank_killed_while_rank_0_writes_the_structure(parallel_runs):
    """Rank 1 is killed (SIGKILL) while rank 0 writes the structure of a save over a previous checkpoint, before any
    rank writes a shard: rank 0's wait for the others then fails in gloo, and so does the ranks' final exchange of
    who failed. Rank 0 raises a ``CheckpointError`` saying that a rank was lost (gloo's error names none) within
    seconds, not gloo's bare ``RuntimeError``; the previous file is untouched and rank 0 removes the temporary file."""
    result, out = parallel_runs.failure("killed_in_structure"), parallel_runs.folder("killed_in_structure")
    assert not result.timed_out, result.output[-8000:]
    assert result.returncode == 0, f"rank 0 did not finish:\n{result.output[-8000:]}"
    assert not (out / "rank1.json").exists(), "rank 1 was not killed"
    rank0 = json.loads((out / "rank0.json").read_text())
    raised = rank0["raised"] or ""
    assert raised.startswith("Saving the checkpoint to ") and "last.ckpt' failed: RuntimeError: " in raised, rank0
    assert "; then the ranks could not tell each other which of them failed: their exchange failed with" in raised
    assert f"(a rank was lost, or is slower than `PL_CHECKPOINT_TIMEOUT` ({KILLED_TIMEOUT} s))" in raised
    assert rank0["raised_time"] - _fault_time(out) < 10
    assert rank0["unchanged"] is True
    assert rank0["temporary_files"] == [] and not list(out.glob("*.tmp"))


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_rank_killed_while_writing_its_shards_in_the_background(parallel_runs):
    """As above, with ``async_checkpoint=True``: rank 1 is killed in its writer thread's ``pwrite`` of a shard of a
    save in the background; rank 0's ``wait_for_checkpoint`` raises a ``CheckpointError`` naming rank 1 within
    seconds (not gloo's bare error naming no rank), the previous file is untouched and no temporary file is left."""
    result, out = parallel_runs.failure("async_killed"), parallel_runs.folder("async_killed")
    assert not result.timed_out, result.output[-8000:]
    assert not (out / "rank1.json").exists(), "rank 1 was not killed"
    rank0 = json.loads((out / "rank0.json").read_text())
    assert rank0["in_background"] == [True], rank0
    expected = "in the background failed on global rank 1: it did not reach the ranks' next exchange"
    assert expected in (rank0["raised"] or ""), rank0
    assert f"`PL_CHECKPOINT_TIMEOUT` ({KILLED_TIMEOUT} s)" in rank0["raised"]
    assert rank0["raised_time"] - _fault_time(out) < 10
    assert rank0["unchanged"] is True
    assert rank0["temporary_files"] == [] and not list(out.glob("*.tmp"))


def test_checkpoint_writers_is_checked():
    assert _checked_checkpoint_writers("all") == "all"
    with pytest.raises(MisconfigurationException, match="'auto', 'all', 'rank0'"):
        _checked_checkpoint_writers("every")


def test_blocks_touched_by_several_ranks_have_one_writer(monkeypatch):
    """Three ranks' ranges in one block, shards that end inside a block, a record inside one block, a range over
    several blocks: every block is written by one rank, the one whose range covers its first written byte."""
    from pytorch_lightning.strategies.fsdp_parallel_save import _block_owners, _Extent, _split_at_blocks

    extents = [
        _Extent(0, 5000, 0, ("param", 0, 0), 0),
        _Extent(5000, 100, 1, ("param", 0, 0), 0),
        _Extent(5100, 100, 2, ("param", 0, 0), 0),
        _Extent(5248, 30000, 0, ("optim", "a"), 0),
    ]
    parts = _split_at_blocks(extents, _block_owners(extents, BLOCK), BLOCK)
    writers = {}
    for owner, part in parts:
        for block in range(part.offset // BLOCK, (part.offset + part.nbytes - 1) // BLOCK + 1):
            assert writers.setdefault(block, owner) == owner
    assert writers == {block: 0 for block in range(9)}
    assert sum(part.nbytes for _, part in parts) == sum(extent.nbytes for extent in extents)
    optimizer_parts = [(p.offset, p.at) for _, p in parts if p.source == ("optim", "a")]
    assert optimizer_parts[:2] == [(5248, 0), (8192, 2944)]

    monkeypatch.setenv("PL_CHECKPOINT_WRITE_BLOCK", "1048576")
    from pytorch_lightning.strategies.fsdp_parallel_save import _write_block_size

    assert _write_block_size() == 2**20
    monkeypatch.setenv("PL_CHECKPOINT_WRITE_BLOCK", "1000")
    with pytest.raises(MisconfigurationException, match="multiple of 4096"):
        _write_block_size()


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_parallel_save_fixed_costs(parallel_runs):
    """One parallel save reads each rank's mount table once, and exchanges no more flags and objects than it needs:
    rank 0's structure decision, record table and probe file travel in one broadcast, and the ranks agree once
    before the block exchange."""
    for result in parallel_runs.results("save_costs"):
        assert {key: result[key] for key in SAVE_COSTS} == SAVE_COSTS, result


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_parallel_save_preallocates_on_local_block_filesystems(parallel_runs):
    """Where the temporary file is on ext4 or XFS, its blocks are allocated before any rank writes its shards (each
    rank sees it so): the ranks overwrite allocated blocks instead of filling holes under the inode's lock."""
    from pytorch_lightning.utilities.checkpoint_flush import _mount_of
    from pytorch_lightning.utilities.file_preallocation import PREALLOCATED_FSTYPES

    folder = parallel_runs.batch("two", 2).folder("save_costs")
    mount = _mount_of(str(folder))
    if mount is None or mount.fstype not in PREALLOCATED_FSTYPES:
        pytest.skip(f"{folder} is not on {' or '.join(PREALLOCATED_FSTYPES)} ({mount})")
    for result in parallel_runs.results("save_costs"):
        assert result["allocated"] >= result["size"] > 0, result


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_parallel_save_on_a_full_filesystem(parallel_runs, small_filesystems):
    """A real ext4 too small for the second checkpoint: its preallocation fails with ``ENOSPC`` (without it, a rank's
    write does), the save raises on every rank, the first file is intact and no temporary file is left."""
    if "full" not in small_filesystems:
        pytest.skip(f"no loop mount: {loop_mount_unavailable() or UNMOUNTABLE}")
    results = parallel_runs.results("filesystem-full")
    for result in results:
        assert result["raised"] is not None and "No space left on device" in result["raised"], result
    assert results[0]["unchanged"] is True
    assert results[0]["temporary_files"] == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_parallel_save_where_fallocate_is_refused(parallel_runs, small_filesystems):
    """A real ext4 without extents refuses ``fallocate`` (``EOPNOTSUPP``): the save goes on as without
    preallocation, and its file equals the gathered save's."""
    if "no_fallocate" not in small_filesystems:
        pytest.skip(f"no loop mount: {loop_mount_unavailable() or UNMOUNTABLE}")
    results = parallel_runs.results("filesystem-no_fallocate")
    assert [result["raised"] for result in results] == [None, None]
    assert results[0]["differences"] == [] and results[0]["temporary_files"] == []
