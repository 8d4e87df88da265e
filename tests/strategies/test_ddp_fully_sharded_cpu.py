"""DDPFullyShardedStrategy with real FairScale FSDP on 2 CPU processes (see fsdp_harness/cpu_fsdp.py).

Every test's scenario runs in one launch (``cpu_runs``); each test checks its own case.
"""
import pytest

from fsdp_harness.runner import ScenarioBatch

SCENARIOS = "tests.strategies.fsdp_cpu_scenarios"
CONTENTS = [("on", "wrap"), ("on", "auto_wrap"), ("off", "wrap")]
BATCH_TIMEOUT = 360
pytestmark = pytest.mark.timeout(BATCH_TIMEOUT + 60)


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> ScenarioBatch:
    batch = ScenarioBatch(SCENARIOS, tmp_path_factory.mktemp("cpu"), timeout=BATCH_TIMEOUT)
    batch.add("fit_and_save", "fit_and_save")
    for rank0_only, wrapping in CONTENTS:
        batch.add(f"contents-{rank0_only}-{wrapping}", "checkpoint_contents", "--rank0-only", rank0_only,
                  "--wrapping", wrapping)
    return batch


def test_fit_nested_wrap_and_save_full_checkpoint(cpu_runs):
    rank0, rank1 = cpu_runs.results("fit_and_save")
    # Each rank holds half of the flat parameters, yet the file has every full tensor, equal to the gathered ones.
    assert rank0["local_numel"] * 2 == rank0["full_numel"]
    assert rank0["file_keys"] == rank0["full_param_keys"] == rank1["full_param_keys"]
    assert len(rank0["file_keys"]) == 6
    assert rank0["mismatched"] == []


@pytest.mark.parametrize("rank0_only, wrapping", CONTENTS, ids=["on-wrap", "on-auto", "off"])
def test_checkpoint_contents(cpu_runs, rank0_only, wrapping):
    rank0, rank1 = cpu_runs.results(f"contents-{rank0_only}-{wrapping}")
    expected_keys = rank0["full_keys"]
    # non-FSDP parameters registered before ("before") and after ("after") the FSDP stack are part of it
    assert {"before", "after"} <= set(expected_keys)
    assert rank0["fsdp_instances"] >= 3
    assert rank0["module_state_keys"] == expected_keys
    assert rank0["dumped_state_dict_tensors"] == len(expected_keys)

    if rank0_only == "on":
        # not even the non-FSDP "after" entry survives on rank 1: exactly {}
        assert rank1["module_state_keys"] == []
        assert rank1["module_state_tensors"] == rank1["dumped_state_dict_tensors"] == 0
        assert rank1["dumped_optimizer_state_keys"] == []
    else:
        # upstream behaviour: every rank builds the full state dict and sees its own optimizer state
        assert rank1["module_state_keys"] == expected_keys
        assert rank1["dumped_state_dict_tensors"] == len(expected_keys)
        assert rank1["dumped_optimizer_state_keys"] == ["param_groups", "state"]
    assert rank0["dumped_optimizer_state_keys"] == ["param_groups", "param_names", "state"]

    # every file rank 0 wrote loads strictly into the unsharded model and equals the gathered parameters
    files = rank0["files"]
    assert set(files) == {"full.ckpt", "weights.ckpt", "last.ckpt"}
    for name, report in files.items():
        assert report["keys"] == expected_keys, name
        assert report["mismatched"] == [], name
    assert files["full.ckpt"]["has_optimizer_states"]
    assert not files["weights.ckpt"]["has_optimizer_states"]
    assert len(rank0["top_k"]) == 2 and rank0["top_k_loadable"]
