"""A script that resumes, saves and ends exits cleanly on every rank (``tests/strategies/fsdp_exit_runs.py``, 2 CPU
ranks over gloo per run): the fork's gloo groups are destroyed, and their threads joined, before the interpreter
finalizes, so no gloo thread aborts the process at exit (``terminate called without an active exception``)."""
import json
import sys

import pytest

from fsdp_harness.multiprocess import assert_success, run_module

RUNS = 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task, sets thread affinities")
@pytest.mark.timeout(300)
def test_resumed_runs_exit_with_status_0(tmp_path):
    """30 runs (catching an abort that hits 1 run in 10 with probability 0.96), 3 at a time; before the save each rank
    starves its gloo threads as a busy node would (see ``fsdp_exit_runs``), which made 2 runs in 3 abort without the
    fix. The first run's ranks also report that the fork's groups, and their threads, are gone once its exit hook
    has run."""
    # numpy's OpenBLAS pool would make the driver a multi-threaded process, which must not fork
    env = {"OPENBLAS_NUM_THREADS": "1"}
    args = ["--out", str(tmp_path), "--runs", str(RUNS), "--parallel", "3"]
    assert_success(run_module("tests.strategies.fsdp_exit_runs", args, timeout=270, env=env))
    statuses = json.loads((tmp_path / "statuses.json").read_text())
    first, runs = statuses["first"], statuses["runs"]
    failed = [run for run in [first, *runs] if run["exit"] != [0, 0]]
    assert not failed, "\n\n".join(
        [_describe(run) for run in failed[:3]]
        + [f"{len(failed)} of {RUNS + 1} runs failed: {[(run['job'], run['exit']) for run in failed]}"]
    )
    # every run resumed from the first run's epoch: one more epoch of the same steps
    assert all(run["global_step"] == [2 * first["global_step"][0]] * 2 for run in runs), runs
    assert sum(run["async"] for run in runs) == RUNS // 2
    for threads in first["threads"]:
        before, after = threads["before"], threads["after"]
        # the background-save group was destroyed at the end of `fit`; the checkpoint group, which a save after `fit`
        # still uses, at exit; the program's groups are left
        assert (before["fork_groups"], after["fork_groups"]) == (1, 0), threads
        assert after["groups"] == before["groups"] - 1, threads
        # and so are their gloo worker threads, as many per group as the others have
        assert after["workers"] * before["groups"] == before["workers"] * after["groups"], threads


def _describe(run):
    logs = "\n".join(f"rank {rank}: ...{log}" for rank, log in run["logs"].items())
    return f"{run['job']}: exit statuses {run['exit']} (-6: SIGABRT)\n{logs}"
