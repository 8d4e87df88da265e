"""DDPFullyShardedStrategy with real FairScale FSDP on 2 CPU processes (see tests/helpers/cpu_fsdp.py)."""
import pytest

from tests.helpers.multiprocess import assert_success, run_module
from tests.helpers.scenario import read_results

SCENARIOS = "tests.strategies.fsdp_cpu_scenarios"


def run_scenario(name, tmp_path, *args, timeout=180):
    result = run_module(SCENARIOS, [name, "--out", str(tmp_path), *args], timeout=timeout)
    assert_success(result)
    return read_results(tmp_path, 2)


@pytest.mark.timeout(240)
def test_fit_nested_wrap_and_save_full_checkpoint(tmp_path):
    rank0, rank1 = run_scenario("fit_and_save", tmp_path)
    # Each rank holds half of the flat parameters, yet the file has every full tensor, equal to the gathered ones.
    assert rank0["local_numel"] * 2 == rank0["full_numel"]
    assert rank0["file_keys"] == rank0["full_param_keys"] == rank1["full_param_keys"]
    assert len(rank0["file_keys"]) == 6
    assert rank0["mismatched"] == []
