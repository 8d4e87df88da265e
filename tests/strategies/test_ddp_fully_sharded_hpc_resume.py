"""A requeued SLURM job resumes ``DDPFullyShardedStrategy`` from its newest HPC checkpoint although the folder holds
the temporary files of killed saves and other ``*ckpt_*`` names (the fork/streaming-atomic-save patch): 2 CPU ranks
over gloo, each a task of a fake ``srun``, so that Lightning runs under ``SLURMEnvironment``. The scan itself, kind
by kind, is tested in ``tests/checkpointing/test_hpc_checkpoint_names.py``."""
import pytest

from fsdp_harness.multiprocess import assert_success, run_module
from fsdp_harness.scenario import read_results


@pytest.mark.timeout(400)
def test_requeued_job_resumes_from_the_newest_committed_hpc_checkpoint(tmp_path):
    srun = ["--ntasks", "2", "--", "-m", "tests.strategies.fsdp_hpc_resume_scenarios"]
    result = run_module("tests.helpers.fake_srun", [*srun, "requeue_with_debris", "--out", str(tmp_path)], timeout=300)
    assert_success(result)
    ranks = read_results(tmp_path, 2)
    planted = ranks[0]["planted"]
    for rank, outcome in enumerate(ranks):
        first, requeued = outcome["jobs"]
        assert [job["environment"] for job in outcome["jobs"]] == ["SLURMEnvironment"] * 2
        assert [job["rank"] for job in outcome["jobs"]] == [rank] * 2
        assert (first["loaded"], first["saved"]) == ([], ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"])
        # with the debris next to them: the newest committed checkpoint, restored exactly, and the next number
        assert (requeued["loaded"], requeued["start_step"]) == (["hpc_ckpt_2.ckpt"], 2)
        assert requeued["mismatches"] == [] and requeued["saved"] == ["hpc_ckpt_3.ckpt"]
    # the resume removed the debris of the save killed on this host; what may still be written elsewhere stays
    kept = sorted(name for kind, name in planted.items() if kind != "this host, writer dead")
    committed = ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt", "hpc_ckpt_3.ckpt"]
    assert ranks[0]["files"] == sorted(committed + kept)
