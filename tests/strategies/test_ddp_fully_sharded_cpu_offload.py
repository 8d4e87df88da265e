"""``DDPFullyShardedStrategy(cpu_offload=True)`` with parameters and buffers outside FSDP: FairScale keeps the FSDP
shards on the CPU and computes on the root device, and what no FSDP instance manages is put on the root device too,
so the replicated parameters compute, and their gradients are averaged, where the FSDP units compute.

Scenarios in ``fsdp_resume_scenarios.py`` (``--layout offload``). On CPU ranks the root device is the CPU as well,
so the CPU run checks that the offload trains, saves and resumes exactly, and where everything is; the device
mismatch that the placement prevents shows on GPUs only (the multi-GPU test).
"""
from pathlib import Path

import pytest
import torch

from fsdp_harness.runner import ScenarioBatches
from tests.helpers.runif import RunIf
from tests.strategies.test_ddp_fully_sharded_resume import check_exact_resume, new_batches, plan_exact_resume

OFFLOAD = ("--layout", "offload")


def check_offload(tmp_path: Path, *extra: str, atol: float = 0.0) -> ScenarioBatches:
    """The straight and the resumed run in one launch; returns their batches (case ``offload``)."""
    batches = new_batches(tmp_path)
    plan_exact_resume(batches, "offload", "adam", *OFFLOAD, *extra)
    check_exact_resume(batches, "offload", atol=atol)
    for run in ("straight", "resumed"):
        for rank, result in enumerate(batches.results(f"offload/{run}")):
            where = result["placement"]
            assert where["cpu_offload"] and all(where["cpu_offload"]), where
            # FairScale's offload: the FSDP shards on the CPU
            assert where["shards"] == ["cpu"], where
            # the rest where the computation is, and the replicated gradients averaged there
            assert where["outside"] == [where["root"]] and where["module"] == where["root"], where
            assert result["syncs"] > 0 and result["sync_devices"] == [where["root"]], result
            if "--accelerator" in extra:
                assert where["root"] == f"cuda:{rank}", where
    return batches


@pytest.mark.timeout(420)
def test_cpu_offload_with_parameters_outside_fsdp_resumes_exactly(tmp_path):
    resumed = check_offload(tmp_path).folder("offload/resumed")
    # the replicated parameters were trained, and are the same on every rank
    states = [torch.load(resumed / f"rank{r}.pt", weights_only=False)["params"] for r in range(2)]
    assert all(torch.equal(states[0][name], states[1][name]) for name in ("before", "after", "shift"))
    assert not torch.equal(states[0]["before"], torch.linspace(-1, 1, 8))


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.timeout(600)
def test_cpu_offload_with_parameters_outside_fsdp_multi_gpu(tmp_path):
    """Before the parameters outside FSDP were put on the root device, the first forward failed: they stayed on
    the CPU, the batch and FairScale's gathered parameters were on the GPU."""
    check_offload(tmp_path, "--accelerator", "gpu", atol=1e-6)
