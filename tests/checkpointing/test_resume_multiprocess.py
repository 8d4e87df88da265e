"""Resume on 2 CPU ranks (DDP over gloo): every rank memory-maps the same checkpoint and restores it exactly."""
import inspect
import sys

import pytest
import torch

from fsdp_harness.runner import run_scenario


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.skipif("mmap" not in inspect.signature(torch.load).parameters, reason="torch.load(mmap=True)")
def test_ddp_resume_shares_memory_mapped_checkpoint(tmp_path):
    ranks = run_scenario("tests.checkpointing.resume_scenarios", "ddp_resume", tmp_path, timeout=240)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["global_step"] == 5
        # model weights and Adam's exp_avg/exp_avg_sq came straight from the file's pages on both ranks
        assert r["mapped"] and all(r["mapped"]), r["mapped"]
        assert r["optimizer_state_tensors"] > 0
        assert r["model_mismatches"] == [] and r["optimizer_mismatches"] == []
        assert r["stray_files"] == []
