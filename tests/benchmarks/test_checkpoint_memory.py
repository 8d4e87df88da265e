"""Smoke tests of the checkpoint-memory benchmark, run as a user runs it
(``python -m fsdp_benchmarks.checkpoint_memory`` or ``python fsdp_benchmarks/checkpoint_memory.py``), never imported:
the tests and the benchmarks share only ``fsdp_harness``. At a tiny size it completes, the JSON has the documented
schema, every configuration's checkpoint is correct, and the plot is written. Memory figures are measured by the
benchmark itself, never asserted here (they are too noisy for a timed unit test).

CI's smoke run takes three of the configurations, one of each kind (``SMOKE_CONFIGS``), in one invocation under the
emulated per-writer bandwidth (``--write-mbps``): each costs a 2-rank launch, and the suite has a time budget. The
others combine the same paths (another optimizer, another save option, a baseline layout); before a release,
``test_every_configuration_smoke`` runs them all (``PL_RUN_RELEASE_TESTS=1``, see CONTRIBUTING.md). The fork-build
configurations pass ``stream_checkpoint`` to the strategy, so they need a build of the fork that has that argument.

The remote configurations (``s3://``: the runner starts a moto server and a proxy per rank) are smoke-tested by
``test_remote_configuration_smoke``, one of them (``REMOTE_SMOKE``), and before a release all of them with the others.
It reads the CI smoke run's invocation, which runs ``REMOTE_SMOKE`` after ``SMOKE_CONFIGS`` (as the release run runs
every configuration in one invocation): an invocation of its own would pay another start of the benchmark's runner,
which imports torch and Lightning."""
import json
import os
import subprocess
import sys

import pytest

from fsdp_harness.multiprocess import ROOT

MODULE = "fsdp_benchmarks.checkpoint_memory"
CONFIGS = [
    "upstream", "rank0-only", "fork", "fork-stream", "upstream-adam", "fork-adam", "fork-stream-adam",
    "fork-async", "fork-async-adam", "fork-parallel", "fork-parallel-adam", "fork-parallel-async", "dcp-fsdp2",
    "dcp-fsdp2-adam",
    "fork-stream-consolidated", "fork-stream-adam-consolidated", "fork-no-agreement",
    "fork-stream-no-agreement", "fork-parallel-no-crc", "fork-parallel-adam-no-crc", "fork-stream-no-crc",
    "fork-s3", "fork-s3-rank0", "fork-s3-async", "dcp-fsspec-s3",
]
#: one of each kind of run: pure 1.6.5 on its own build; the fork's default writer (every rank writes, checked
#: against a gathered save as the streamed configurations are), with Adam; the DCP peer. The other configurations
#: combine the same paths (``test_every_configuration_smoke``); the upstream PR's own I/O (``rank0-only``) also runs
#: on 2 CPU ranks in ``test_ddp_fully_sharded_state_dict_on_rank_0_only_cpu.py``.
SMOKE_CONFIGS = ["upstream", "fork-parallel-adam", "dcp-fsdp2"]
#: the remote configuration of the CI smoke run, checked by ``test_remote_configuration_smoke``
REMOTE_SMOKE = "fork-s3"
INCOMPLETE = {"upstream", "upstream-adam"}  # pure 1.6.5: rank 0's optimizer shard only
STREAMED = {
    "fork-stream", "fork-stream-adam", "fork-stream-consolidated", "fork-stream-adam-consolidated",
    "fork-stream-no-agreement", "fork-stream-no-crc",
}
PARALLEL = {
    "fork-parallel", "fork-parallel-adam", "fork-parallel-async", "fork-parallel-no-crc", "fork-parallel-adam-no-crc",
}
DCP = {"dcp-fsdp2", "dcp-fsdp2-adam"}
#: to S3, through a proxy per rank that counts the bytes each rank sends to and receives from the server
REMOTE = {"fork-s3", "fork-s3-rank0", "fork-s3-async", "dcp-fsspec-s3"}
#: S3's smallest part, moto's too: a tiny checkpoint (about 16 MiB) is then several parts, so every rank uploads
PART_BYTES = 5 * 2**20
RUN_KEYS = {
    "config", "world_size", "state_dict_mb", "ranks", "node_save_peak_extra_anon_file_mb", "node_save_peak_extra_mb",
    "node_load_peak_extra_mb", "node_load_peak_extra_file_mb", "node_save_x_s", "node_load_x_s", "checkpoint_mb",
    "complete_checkpoint", "optimizer_state_complete", "lightning_version", "ok",
}
RANK_KEYS = {
    "rank", "save_peak_extra_mb", "save_peak_extra_anon_file_mb", "save_peak_extra_file_mb", "save_seconds",
    "load_peak_extra_mb", "load_peak_extra_anon_file_mb", "load_peak_extra_file_mb", "load_seconds",
    "load_state_seconds", "load_bytes_read", "load_collective_bytes", "load_unit_gathers", "save_bytes_written",
    "save_io_seconds", "save_crc_seconds", "load_crc_seconds",
}
#: the counts among ``RANK_KEYS`` (the rest are MiB and seconds)
RANK_COUNTS = {"rank", "load_bytes_read", "load_collective_bytes", "load_unit_gathers", "save_bytes_written"}
#: what only the fork's strategy measures (its loads' own counters); the DCP peer has the file sizes instead
STRATEGY_KEYS = {"load_state_seconds", "load_collective_bytes", "load_unit_gathers", "load_crc_seconds"}
DCP_RANK_KEYS = RANK_KEYS - STRATEGY_KEYS | {"save_files_bytes"}


def _environment():
    # As a user's shell has it: no repository root on PYTHONPATH, so only the benchmark itself can make it importable.
    # The fork's S3 parts at S3's minimum (the default 16 MiB would make the tiny checkpoint one part, one uploader).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PL_CHECKPOINT_PART_BYTES": str(PART_BYTES)}


def run_benchmark(*args, cwd=ROOT, timeout=60, file_form=False):
    start = [str(ROOT / "fsdp_benchmarks" / "checkpoint_memory.py")] if file_form else ["-m", MODULE]
    return subprocess.run([sys.executable, *start, *args], cwd=cwd, env=_environment(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _check_lightning_run(run):
    """A Lightning configuration's run: the schema, its build, a complete file where the configuration promises one,
    the streamed file checked against a gathered save, and rank 0 the only writer (except the parallel save)."""
    assert RUN_KEYS <= set(run), run
    # 1.6.5 runs on its own build and writes rank 0's optimizer shard; everything else the whole state
    assert run["lightning_version"].endswith(".compat") == (run["config"] in INCOMPLETE)
    assert run["complete_checkpoint"] is run["optimizer_state_complete"] is (run["config"] not in INCOMPLETE)
    if run["config"] in STREAMED | PARALLEL:
        assert run["stream_check"]["compared"] > 0 and run["stream_check"]["mismatched"] == []
    assert run["checkpoint_mb"] >= run["state_dict_mb"]
    for rank in run["ranks"]:
        assert RANK_KEYS <= set(rank), rank
        assert all(isinstance(rank[k], float) for k in RANK_KEYS - RANK_COUNTS)
        assert all(isinstance(rank[k], int) for k in RANK_COUNTS)
        # every configuration reads at least each rank's share of the weights (S / N)
        assert rank["load_bytes_read"] >= run["state_dict_mb"] * 2**20 / run["world_size"] * 0.9
    written = [rank["save_bytes_written"] for rank in run["ranks"]]
    file_bytes = run["checkpoint_mb"] * 2**20
    if run["config"] in PARALLEL:
        # checkpoint_writers="all": one file, and every rank writes its own shards of it (rank 0 also the structure)
        assert all(w > 0 for w in written) and file_bytes <= sum(written) <= file_bytes * 1.05, written
    else:
        # one writer: rank 0 writes the whole file once, the other ranks nothing (the streamed configurations pin
        # checkpoint_writers="rank0", and a gathered save is rank 0's whatever checkpoint_writers says)
        assert file_bytes <= written[0] <= file_bytes * 1.05 and written[1:] == [0] * (len(written) - 1), written


def _check_dcp_run(run):
    """The torch DCP peer's run: each rank writes its own file (rank 0 also the metadata), the counted bytes match
    the files, and every shard loads back equal."""
    assert run["optimizer_state_complete"] is True
    assert run["tensor_check"]["compared"] > 0 and run["tensor_check"]["mismatched"] == []
    momentum = 2 if run["config"].endswith("-adam") else 1  # Adam: two states per parameter
    share = run["state_dict_mb"] * 2**20 * (1 + momentum) / run["world_size"]
    for rank in run["ranks"]:
        assert DCP_RANK_KEYS <= set(rank), rank
        assert rank["save_files_bytes"] == pytest.approx(share, rel=0.05)
        assert rank["save_files_bytes"] <= rank["save_bytes_written"] <= rank["save_files_bytes"] * 1.05
        assert rank["load_bytes_read"] >= rank["save_files_bytes"]


def _check_remote_run(run):
    """A remote configuration's run: every rank counted its bytes to and from the server; the fork's ranks upload the
    object once between them (``fork-s3-rank0``: rank 0 alone), and every rank receives at least its share of the
    checkpoint while resuming (each rank fetches its own ranges)."""
    assert run["storage"] == "s3" and run["optimizer_state_complete"] is True
    file_bytes = run["checkpoint_mb"] * 2**20
    sent = [rank["save_server_sent"] for rank in run["ranks"]]
    for rank in run["ranks"]:
        counts = [rank[f"{phase}_server_{key}"] for phase in ("save", "load") for key in ("sent", "received")]
        assert all(isinstance(count, int) for count in counts), rank
        assert rank["load_server_received"] >= file_bytes / run["world_size"] * 0.9, rank
    if run["config"] == "fork-s3-rank0":
        assert sent[0] >= file_bytes and sent[1:] == [0] * (len(sent) - 1), sent
    else:
        assert all(s > 0 for s in sent) and file_bytes <= sum(sent) <= file_bytes * 1.05, sent
    if run["config"] == "dcp-fsspec-s3":
        assert run["tensor_check"]["compared"] > 0 and run["tensor_check"]["mismatched"] == []


def _check_result(result, configs, mbps):
    runs = result["runs"]
    assert [run["config"] for run in runs] == result["meta"]["configs"] == configs
    assert result["meta"].get("skipped", {}) == {}
    assert result["meta"]["write_mbps"] == mbps and "emulated" in result["meta"]["write_bandwidth"]
    for run in runs:
        assert run["ok"] is True, run
        assert run["world_size"] == 2 and [r["rank"] for r in run["ranks"]] == [0, 1]
        # 4 blocks of 640 and the two heads of 320 (``--width``, ``--heads``)
        assert 7 < run["state_dict_mb"] <= 8 and run["heads"] == 320
        assert "INCOMPLETE" in result["meta"]["configurations"][run["config"]].upper() or run["complete_checkpoint"]
        if run["config"] in REMOTE:
            _check_remote_run(run)
        else:
            (_check_dcp_run if run["config"] in DCP else _check_lightning_run)(run)
        assert run["node_save_peak_extra_mb"] == pytest.approx(sum(r["save_peak_extra_mb"] for r in run["ranks"]))
        assert run["node_save_peak_extra_anon_file_mb"] == pytest.approx(
            sum(r["save_peak_extra_anon_file_mb"] for r in run["ranks"])
        )
        assert run["node_load_peak_extra_mb"] == pytest.approx(sum(r["load_peak_extra_mb"] for r in run["ranks"]))
        if run["config"] in DCP | PARALLEL:
            # under the emulated link, a rank's save takes at least its bytes over the cap
            assert run["write_mbps"] == mbps
            for rank in run["ranks"]:
                assert rank["save_seconds"] >= rank["save_bytes_written"] / (mbps * 1e6)
                # the writes and syncs of the checkpoint, which waited for the link, are its I/O seconds
                assert rank["save_seconds"] >= rank["save_io_seconds"] >= rank["save_bytes_written"] / (mbps * 1e6)


SMOKE_MBPS = 20.0


def _run_smoke(tmp_path, configs, timeout):
    """One invocation of the benchmark at the tiny size, under the emulated per-writer link; its output."""
    return run_benchmark(
        "--devices", "2", "--units", "4", "--width", "640", "--heads", "320", "--accelerator", "cpu", "--json",
        str(tmp_path / "result.json"),
        "--plot", str(tmp_path / "result.png"), "--out", str(tmp_path / "out"), "--timeout", "180", "--write-mbps",
        str(SMOKE_MBPS), "--configs", ",".join(configs),
        timeout=timeout,
    )


def _smoke(tmp_path, configs, timeout):
    _check_smoke(tmp_path, _run_smoke(tmp_path, configs, timeout), configs)


def _check_smoke(tmp_path, proc, configs):
    json_path, plot_path, mbps = tmp_path / "result.json", tmp_path / "result.png", SMOKE_MBPS
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "node" in proc.stdout  # the table
    assert "emulated per-rank write link of 20 MB/s" in proc.stdout
    result = json.loads(json_path.read_text())
    _check_result(result, configs, mbps)
    assert set(result["meta"]["builds"]) == {"compat", "fork"}
    assert result["meta"]["builds"]["compat"].endswith(".compat")
    assert (result["meta"]["width"], result["meta"]["heads"]) == (640, 320)
    assert plot_path.stat().st_size > 1000
    # --out keeps rank results and logs, but not the S-sized checkpoints or DCP's files
    assert not list((tmp_path / "out").rglob("*.ckpt")) and not list((tmp_path / "out").rglob("*.distcp"))


#: every test that reads the CI smoke run's invocation may be the one that starts it
SMOKE_TIMEOUT = 420


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The CI smoke run's invocation (``SMOKE_CONFIGS`` and ``REMOTE_SMOKE``): its folder and its output."""
    folder = tmp_path_factory.mktemp("checkpoint-memory-smoke")
    return folder, _run_smoke(folder, [*SMOKE_CONFIGS, REMOTE_SMOKE], timeout=SMOKE_TIMEOUT - 20)


@pytest.mark.timeout(SMOKE_TIMEOUT)
def test_checkpoint_memory_benchmark_smoke(smoke_run):
    """One run of each kind of configuration (see the module's docstring), under the emulated per-writer link."""
    folder, proc = smoke_run
    _check_smoke(folder, proc, [*SMOKE_CONFIGS, REMOTE_SMOKE])


@pytest.mark.release
@pytest.mark.timeout(900)
def test_every_configuration_smoke(tmp_path):
    """Before a release: every configuration at the tiny size, checked as the CI smoke run checks its three."""
    _smoke(tmp_path, CONFIGS, timeout=880)


@pytest.mark.timeout(SMOKE_TIMEOUT)
def test_remote_configuration_smoke(smoke_run):
    """``fork-s3`` at the tiny size on 2 CPU ranks: the runner starts a moto server and a proxy per rank, the object
    resumes exactly, and the remote table and the JSON carry each rank's bytes to and from the server."""
    folder, proc = smoke_run
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "object storage (s3://" in proc.stdout and "sent saving MiB (xF/N)" in proc.stdout
    result = json.loads((folder / "result.json").read_text())
    assert "moto" in result["meta"]["object_storage"]
    (run,) = [run for run in result["runs"] if run.get("storage") == "s3"]
    assert run["ok"] is True and run["config"] == "fork-s3" and [r["rank"] for r in run["ranks"]] == [0, 1]
    _check_remote_run(run)
    for rank in run["ranks"]:
        assert rank["save_server_sent"] > 0 and rank["load_server_received"] > 0, rank
        assert "UploadPart" in rank["save_server_by_op"] and "GetObjectRange" in rank["load_server_by_op"]


@pytest.mark.timeout(120)
def test_started_as_a_file_from_anywhere(tmp_path):
    """``python fsdp_benchmarks/checkpoint_memory.py`` imports its package and the harness from another folder too,
    and FairScale's top-level ``benchmarks`` package does not get in the way."""
    proc = run_benchmark("--help", cwd=tmp_path, file_form=True)
    assert proc.returncode == 0, proc.stdout
    assert "--devices" in proc.stdout and "--configs" in proc.stdout


@pytest.mark.timeout(120)
def test_unknown_configuration_is_rejected():
    proc = run_benchmark("--configs", "nope")
    assert proc.returncode == 2, proc.stdout
    assert "unknown configuration(s) ['nope']; known: " + ", ".join(CONFIGS) in proc.stdout


def _synthetic_run(config, world_size, save_x, load_x, complete=True):
    """A run as the benchmark's JSON has it, with made-up figures in units of S."""
    size = 8.0
    rank = {k: 1.0 for k in RANK_KEYS} | {"rank": 0}
    return {
        "config": config, "world_size": world_size, "state_dict_mb": size, "ranks": [rank],
        "node_save_peak_extra_anon_file_mb": save_x * size, "node_save_peak_extra_mb": save_x * size,
        "node_load_peak_extra_mb": load_x * size, "node_load_peak_extra_file_mb": 0.0, "node_save_x_s": save_x,
        "node_load_x_s": load_x, "checkpoint_mb": 2 * size, "complete_checkpoint": complete,
        "optimizer_state_complete": complete, "ok": True,
    }


@pytest.mark.timeout(120)
def test_plot_from_saved_results(tmp_path):
    """``python -m fsdp_benchmarks.report RESULT.json --plot OUT.png`` draws a readable two-panel PNG (save, resume)
    from a results file, with one world size or several, and a failed run left out."""
    import matplotlib.image

    runs = [
        _synthetic_run("upstream", 2, 3.6, 3.5, complete=False),
        _synthetic_run("upstream", 4, 5.2, 7.0, complete=False),
        _synthetic_run("fork", 2, 2.1, 1.0), _synthetic_run("fork", 4, 2.4, 1.0),
        {"config": "fork-stream", "world_size": 2, "state_dict_mb": 8.0, "ranks": [], "ok": False, "error": "x"},
    ]
    result = tmp_path / "result.json"
    for name, selected in (("two.png", runs), ("one.png", runs[:1])):
        result.write_text(json.dumps({"runs": selected, "meta": {}}))
        plot_path = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "fsdp_benchmarks.report", str(result), "--plot", str(plot_path)],
                              cwd=ROOT, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=100)
        assert proc.returncode == 0, proc.stdout
        height, width, _ = matplotlib.image.imread(plot_path).shape
        assert width > 1.5 * height > 600  # two panels side by side, at a readable resolution


@pytest.mark.timeout(120)
def test_medians_of_repeated_runs(tmp_path):
    """``python -m fsdp_benchmarks.report RESULT.json`` of a ``--repeat`` run prints, per configuration and N, the
    median of the slowest rank's save time over the repeats, the median time outside the checkpoint's writes and
    syncs, and the ratio of the median to the DCP peer's with the same optimizer."""

    def repeated(config, optimizer, repeat, seconds, io_seconds):
        run = _synthetic_run(config, 2, 1.0, 1.0)
        ranks = [
            dict(run["ranks"][0], rank=rank, save_seconds=s, save_io_seconds=io)
            for rank, (s, io) in enumerate(zip(seconds, io_seconds))
        ]
        return dict(run, ranks=ranks, optimizer=optimizer, repeat=repeat)

    runs = [
        # slowest rank's save: 0.30, 0.12, 0.20 s; outside I/O (most of any rank): 0.10, 0.05, 0.08 s
        repeated("fork-parallel", "sgd", 0, [0.30, 0.25], [0.20, 0.20]),
        repeated("fork-parallel", "sgd", 1, [0.10, 0.12], [0.05, 0.08]),
        repeated("fork-parallel", "sgd", 2, [0.20, 0.15], [0.12, 0.10]),
        repeated("dcp-fsdp2", "sgd", 0, [0.40, 0.30], [0.1, 0.1]),
        repeated("dcp-fsdp2", "sgd", 1, [0.25, 0.25], [0.1, 0.1]),
        repeated("dcp-fsdp2", "sgd", 2, [0.35, 0.30], [0.1, 0.1]),
        repeated("dcp-fsdp2-adam", "adam", 0, [9.0, 9.0], [0.1, 0.1]),  # another optimizer's peer: not compared
    ]
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"runs": runs, "meta": {}}))
    proc = subprocess.run([sys.executable, "-m", "fsdp_benchmarks.report", str(result)], cwd=ROOT,
                          env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in proc.stdout.splitlines() if " 2 " in line}
    # runs, median, outside I/O, x DCP, then the runs' seconds
    assert rows["fork-parallel", "2"][:4] == ["3", "0.200", "0.080", "0.57"], proc.stdout
    assert rows["dcp-fsdp2", "2"][:3] == ["3", "0.350", "0.250"], proc.stdout


@pytest.mark.timeout(120)
def test_crc_cost_table(tmp_path):
    """With a configuration's ``-no-crc`` twin in the results, ``python -m fsdp_benchmarks.report RESULT.json`` prints
    the CRC-32s' cost: the medians of the slowest rank's save and resume times of both, and their ratios."""

    def timed(config, repeat, save, load):
        run = _synthetic_run(config, 2, 1.0, 1.0)
        ranks = [dict(run["ranks"][0], rank=rank, save_seconds=s, load_seconds=t) for rank, (s, t) in
                 enumerate(zip(save, load))]
        return dict(run, ranks=ranks, optimizer="sgd", repeat=repeat)

    runs = [
        # slowest ranks: saves 0.44, 0.40 (median 0.42), loads 0.33, 0.30 (0.315)
        timed("fork-parallel", 0, [0.44, 0.30], [0.20, 0.33]),
        timed("fork-parallel", 1, [0.40, 0.39], [0.30, 0.10]),
        # the twin: saves 0.40, 0.36 (0.38), loads 0.30, 0.26 (0.28)
        timed("fork-parallel-no-crc", 0, [0.40, 0.20], [0.30, 0.30]),
        timed("fork-parallel-no-crc", 1, [0.10, 0.36], [0.26, 0.20]),
        timed("fork-stream", 0, [1.0, 1.0], [1.0, 1.0]),  # no twin: no row
    ]
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"runs": runs, "meta": {}}))
    proc = subprocess.run([sys.executable, "-m", "fsdp_benchmarks.report", str(result)], cwd=ROOT,
                          env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout
    table = proc.stdout[proc.stdout.index("the CRC-32s' cost"):].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[2:] if line.strip()}
    # the synthetic ranks spent 1 s in CRC-32s in each phase (every field of ``_synthetic_run`` is 1.0)
    assert rows == {
        "fork-parallel": ["2", "2", "0.420", "0.380", "1.11", "1.0000", "0.315", "0.280", "1.12", "1.0000"]
    }, proc.stdout
