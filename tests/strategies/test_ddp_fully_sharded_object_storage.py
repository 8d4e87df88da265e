"""FSDP checkpoints in object storage (``s3://``): every rank uploads its own parts of one ordinary object (a
multipart upload that global rank 0 starts and completes), which is the file a local save writes, byte for byte.

Against a real S3 server process (moto's) with a fault-injecting, byte-counting proxy per rank
(``fsdp_harness/s3_server.py``, ``fsdp_harness/s3_proxy.py``); the ranks are real FairScale FSDP processes on CPU
(``fsdp_object_storage_scenarios.py``), in three launches: a 2-rank job that is killed mid-upload, the next 2-rank
job (which first resumes in the killed job's directory, then runs the other cases), then 1 rank resuming the 2-rank
object. The model's file is about 25 MB, 5 parts of 5 MiB (``PL_CHECKPOINT_PART_BYTES``), so both ranks upload parts
and a rank uploads its parts in more than one round (``SMALL``: about 10 MB, 2 parts, one per rank).
"""
import json
from typing import Dict, Iterator, List

import pytest

from fsdp_harness.multiprocess import assert_success, run_tasks
from fsdp_harness.runner import ScenarioBatches
from fsdp_harness.s3_proxy import S3Proxy, start_proxy
from fsdp_harness.s3_server import apply_env, make_bucket, rank_endpoints_env
from fsdp_harness.scenario import read_results
from tests.helpers.fake_slurm import install_fake_scontrol, slurm_task_envs
from tests.helpers.runif import RunIf
from tests.strategies.fsdp_async_scenarios import WRITER_THREAD
from tests.trainer.connectors.slurm_requeue_scenarios import SIGNALLED_BATCH

pytest_plugins = ["tests.helpers.s3"]

SCENARIOS = "tests.strategies.fsdp_object_storage_scenarios"
PART_BYTES = 5 * 2**20
#: two attempts per request, so that a part refused every time fails in seconds
ENV = {"PL_CHECKPOINT_PART_BYTES": str(PART_BYTES), "PL_CHECKPOINT_TIMEOUT": "60"}
#: "killed": every rank of the job kills itself mid-upload; "two", the next job, starts in the killed job's directory
#: (a launch of its own for that would pay a third 2-rank start); "one" resumes what "two" saved
BATCHES = {"killed": (2, 120), "two": (2, 330), "one": (1, 150)}
BATCHES_TIMEOUT = sum(timeout for _, timeout in BATCHES.values()) + 60
#: A model of about 10 MB (2 parts, one per rank) for the cases that save it again and again: what they check holds
#: at any size where every rank uploads a part, and the 5-part file (more than one round of a rank's parts) is
#: checked by the other cases.
SMALL = ["--width", 640]
#: the faults of one rank's uploads, and whether the save survives them (the client retries)
FAULTS = {"internal_error": False, "slow_down": True, "reset": True}


@pytest.fixture(scope="module")
def proxies(s3_server) -> Iterator[List[S3Proxy]]:
    started = [start_proxy(s3_server.endpoint, []) for _ in range(2)]
    yield started
    for proxy in started:
        proxy.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, s3_server, proxies) -> Iterator[ScenarioBatches]:
    bucket = make_bucket(s3_server.endpoint)
    env = apply_env({**rank_endpoints_env([p.endpoint for p in proxies], max_attempts=2), **ENV})
    batches = ScenarioBatches(SCENARIOS, tmp_path_factory.mktemp("object-storage"))
    for name, (devices, timeout) in BATCHES.items():
        batches.batch(name, devices, timeout, env)
    url = f"s3://{bucket}/run"
    saved = batches.batch("two", 2).add("upload", "upload_equals_local", "--url", url)
    batches.batch("two", 2).add("upload-rank0", "upload_equals_local", "--url", url, "--writers", "rank0")
    resume = ["--ckpt", f"{url}/upload-auto.ckpt", "--local", saved / "local.ckpt"]
    for name, devices in (("two", 2), ("one", 1)):
        batches.batch(name, devices).add(f"resume-2-{devices}", "resume_from_object", *resume)
    batches.batch("two", 2).add("resume_corrupt", "resume_corrupt", "--ckpt", f"{url}/corrupt-auto.ckpt")
    batches.batch("two", 2).add("reading_hooks", "resume_reading_hooks", *resume)
    batches.batch("two", 2).add("missing_range", "resume_missing_range", *resume)
    batches.batch("two", 2).add("part_size", "part_size_differs", "--url", url)
    for name, devices in (("two", 2), ("one", 1)):
        batches.batch(name, devices).add(f"sequential-{devices}", "sequential_store")
    for fault in FAULTS:
        batches.batch("two", 2).add(f"fault-{fault}", "upload_fault", "--url", url, "--fault", fault, *SMALL)
    batches.batch("two", 2).add("missing_bucket", "missing_bucket")
    for mode in ("sync", "async"):
        flag = ["--async-checkpoint"] if mode == "async" else []
        batches.batch("two", 2).add(f"callback-{mode}", "checkpoint_callback", "--url", url, *flag, *SMALL)
    # rank 1 is gone after it: the last case of its batch
    batches.batch("two", 2).add("rank_killed", "killed_mid_upload", "--url", url, fails=True)
    killed = f"{url}/killed-job"
    batches.batch("killed", 2).add("job_killed", "killed_mid_upload", "--url", killed, "--fault-rank", -1, fails=True)
    # first: in processes that did nothing else before, as a new job's would
    batches.batch("two", 2).add("after_killed_job", "after_killed_job", "--url", killed, first=True)
    yield batches


def _sent(record: Dict, op: str = "UploadPart") -> int:
    return record["save"].get(op, {}).get("sent", 0)


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_every_rank_uploads_its_parts_of_the_file_a_local_save_writes(runs):
    records = runs.batch("two", 2).results("upload")
    zero = records[0]
    assert zero["reason"] is None, zero["reason"]  # streamed, not gathered
    assert zero["same_bytes"] and zero["differences"] == []
    assert zero["testzip"] is None and zero["plain_torch_load"] == 8
    assert zero["uploads_in_progress"] == []
    size = zero["size"]
    uploaded = [_sent(record) for record in records]
    assert sum(uploaded) == size
    # every rank uploads its share, to a part: the gathered save uploads everything from rank 0
    assert all(0 < sent <= size / 2 + PART_BYTES for sent in uploaded), uploaded
    # only rank 0 checks the bucket, looks for stale uploads, starts, marks and completes the upload (and removes
    # its marker); no rank reads the object back
    ops = [sorted(op for op, count in record["save"].items() if count["requests"]) for record in records]
    rank_zero = ["CompleteMultipartUpload", "CreateMultipartUpload", "DeleteObject", "HeadBucket", "ListObjectsV2"]
    assert ops == [sorted(rank_zero + ["PutObject", "UploadPart"]), ["UploadPart"]], ops


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("devices", [2, 1])
def test_the_object_resumes_exactly(runs, devices):
    """Resumed on 2 ranks and on 1, training goes on as from the local file; each rank fetches its share of the
    object in ranged GETs (at 1 rank, the whole of it); ``validate`` restores the weights, fetching no optimizer
    state."""
    name = "two" if devices == 2 else "one"
    records = runs.batch(name, devices).results(f"resume-2-{devices}")
    for record in records:
        assert record["global_step"] == 4
        assert record["differences"] == [], record["differences"]
    size = runs.batch("two", 2).results("upload")[0]["size"]
    received = [sum(count["received"] for count in record["load"].values()) for record in records]
    # ranged GETs only, each rank its share: before, every rank downloaded the whole object; rank 0 also looks for
    # the uploads of killed jobs
    ops = [{op for op, count in record["load"].items() if count["requests"]} for record in records]
    allowed = [{"GetObjectRange", "HeadObject", "ListObjectsV2"}, {"GetObjectRange", "HeadObject"}]
    assert all("GetObjectRange" in got and got <= most for got, most in zip(ops, allowed)), ops
    for got in received:
        assert size / devices * 0.9 < got <= size / devices * 1.1, (received, size)
    # ``validate(ckpt_path=...)`` restores the weights exactly and fetches no optimizer state (about half the file
    # with SGD's momentum)
    for record, got in zip(records, received):
        assert record["validate_differences"] == [], record["validate_differences"]
        fetched = sum(count["received"] for count in record["validate"].values())
        assert got * 0.4 < fetched < got * 0.6, (fetched, got)


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_a_flipped_bit_in_the_object_fails_the_resume_on_every_rank(runs):
    """The ranks' CRC-32 check reads their local copies of the object: a flipped bit in a tensor record raises
    ``CheckpointError`` on every rank, naming the URL, before a step runs."""
    records = runs.batch("two", 2).results("resume_corrupt")
    for record in records:
        assert record["error"] is not None and "is corrupt" in record["error"], record["error"]
        assert "corrupt-auto.ckpt" in record["error"] and "/proc/" not in record["error"], record["error"]
        assert record["global_step"] == 2  # as restored: no step ran (fit goes to 4)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_rank_whose_uploads_fail(runs, fault):
    """A part refused every time (HTTP 500 after the client's retries) fails the save on every rank, naming rank 1;
    the upload is aborted and the previous object stays. A throttled rank (503 ``SlowDown`` twice) and a connection
    reset mid-part are retried by the client, and the save completes."""
    records = runs.batch("two", 2).results(f"fault-{fault}")
    assert records[1]["fired"] >= 1
    if FAULTS[fault]:
        assert [record["error"] for record in records] == [None, None]
        assert records[0]["unchanged"] is False
    else:
        for record in records:
            assert record["error"] is not None and "global rank 1" in record["error"], record["error"]
        assert "internal error" in records[1]["error"], records[1]["error"]
        assert records[0]["unchanged"] is True
    assert records[0]["uploads_in_progress"] == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_a_missing_bucket_fails_on_every_rank_and_is_not_created(runs):
    records = runs.batch("two", 2).results("missing_bucket")
    for record in records:
        assert record["error"] is not None and "does not exist" in record["error"], record["error"]
    assert records[0]["bucket_created"] is False


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_checkpoint_keeps_the_top_k_and_last_in_the_bucket(runs, mode):
    """``ModelCheckpoint(save_top_k=2, save_last=True)`` every step: the two best and ``last.ckpt`` are left, the
    others removed (the fork's commits forget s3fs's cached listing, which the removals read); ``last.ckpt`` holds
    the final parameters. With ``async_checkpoint=True`` the parts are uploaded by the ranks' background threads."""
    records = runs.batch("two", 2).results(f"callback-{mode}")
    for record in records:
        expected = ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt", "notes.txt"]
        assert record["objects"] == expected, record["objects"]
        assert record["last_differences"] == [], record["last_differences"]
        assert record["threads"] == ([WRITER_THREAD] if mode == "async" else ["MainThread"]), record["threads"]
    # every rank uploaded its share of every save (4 checkpoints and last.ckpt): the gathered save sent all from rank 0
    sent = [record["sent"] for record in records]
    assert all(0.3 * sum(sent) < got < 0.7 * sum(sent) for got in sent), sent


@RunIf(skip_windows=True)
@pytest.mark.timeout(300)
def test_slurm_requeues_once_the_hpc_checkpoint_is_in_the_bucket(tmp_path, s3_server, proxies):
    """``SIGUSR1`` to both tasks of a Slurm job whose root is in the bucket: the HPC checkpoint saved in the
    background is uploaded and complete when ``scontrol requeue`` runs, and the next fit in that root resumes from
    it (Lightning lists the bucket to find it)."""
    bucket = make_bucket(s3_server.endpoint)
    install_fake_scontrol(tmp_path / "bin")
    endpoints = apply_env(rank_endpoints_env([p.endpoint for p in proxies], max_attempts=2), {})
    envs = [{**env, **endpoints, **ENV} for env in slurm_task_envs(2, 4343, tmp_path / "bin")]
    argv = ["slurm_requeue", "--out", str(tmp_path / "out"), "--url", f"s3://{bucket}/run"]
    assert_success(run_tasks(SCENARIOS, argv, envs, timeout=240))
    records = read_results(tmp_path / "out", 2)
    requeues = [json.loads(line) for line in (tmp_path / "out" / "scontrol.jsonl").read_text().splitlines()]
    assert len(requeues) == 1, requeues
    assert requeues[0]["argv"] == ["requeue", "4343"] and requeues[0]["newest"] == "hpc_ckpt_1.ckpt", requeues
    assert requeues[0]["loads"] and requeues[0]["global_step"] == SIGNALLED_BATCH + 1, requeues
    for record in records:
        first, second = record["fits"]
        assert first["received"] == 1 and second["start_step"] == SIGNALLED_BATCH + 1, record
        # every rank uploaded parts of the HPC checkpoint (the gathered save uploads from rank 0 alone)
        assert first["uploaded_parts"] > 0, record


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_a_rank_killed_mid_upload_fails_the_save_and_aborts_the_upload(runs):
    """Rank 1 killed (``SIGKILL``) before its first part: global rank 0 raises a ``CheckpointError`` naming it within
    ``PL_CHECKPOINT_TIMEOUT``, aborts the upload, and the previous object stays."""
    result, out = runs.failure("rank_killed"), runs.folder("rank_killed")
    assert result.returncode == 0, f"rank 0 did not finish:\n{result.output[-8000:]}"
    assert not (out / "rank1.json").exists(), "rank 1 was not killed"
    zero = json.loads((out / "rank0.json").read_text())
    assert "failed on global rank 1: it did not reach the ranks' next exchange" in (zero["error"] or ""), zero
    assert zero["unchanged"] is True and zero["uploads_in_progress"] == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_the_next_job_aborts_the_upload_of_a_job_killed_mid_upload(runs):
    """Every rank killed mid-upload leaves an incomplete upload and its marker; the next job's resume from that
    directory aborts the upload (its writer's process is gone) and removes the marker."""
    assert runs.failure("job_killed").returncode == -9  # SIGKILL
    for record in runs.batch("two", 2).results("after_killed_job"):
        assert record["before"]["uploads"] == ["run/killed-job/killed.ckpt"], record["before"]
        assert len(record["before"]["markers"]) == 1, record["before"]
        assert record["after"] == {"uploads": [], "markers": []}, record["after"]


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_a_datamodule_reading_the_checkpoint_gets_the_whole_object(runs):
    """A LightningDataModule's ``on_load_checkpoint`` reads full tensors: every rank then fetches the whole object
    (said in one info line), and the hook sees the saved values, not the zeros of unfetched bytes."""
    size = runs.results("upload")[0]["size"]
    for record in runs.results("reading_hooks"):
        assert record["same"] is True
        assert sum(count["received"] for count in record["load"].values()) >= size


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_a_read_of_bytes_never_fetched_fails_the_resume(runs):
    """Where the ranges fetched miss bytes the restore reads (emulated: the largest range left out), the CRC-32
    check says so on every rank instead of resuming from zeros."""
    for record in runs.results("missing_range"):
        assert record["error"] is not None and "had not fetched from the object" in record["error"], record["error"]


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_every_rank_cuts_the_parts_of_rank_zero(runs):
    """``PL_CHECKPOINT_PART_BYTES`` differs between the ranks: they use rank 0's, and the save completes."""
    assert runs.results("part_size")[0]["same_bytes"] is True


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("devices", [2, 1])
def test_a_filesystem_without_multipart_uploads_gets_the_streamed_file(runs, devices):
    """``memory://`` (sequential, like gcsfs and adlfs): streamed by global rank 0 through its scratch file, not
    gathered; the object is the local save's file; in one process it resumes exactly."""
    records = runs.results(f"sequential-{devices}")
    assert records[0]["reason"] is None and records[0]["same_bytes"] is True
    if devices == 1:
        assert records[0]["differences"] == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_checkpoint_writers_rank0_has_global_rank_0_upload_the_object_alone(runs):
    """``checkpoint_writers="rank0"``: global rank 0 streams the save into its scratch file and uploads it alone
    (s3fs's own upload); the object is the local save's file."""
    records = runs.results("upload-rank0")
    zero = records[0]
    assert zero["reason"] is None and zero["same_bytes"] and zero["uploads_in_progress"] == []
    assert _sent(zero) >= zero["size"] and _sent(records[1]) == 0
