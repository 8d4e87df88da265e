"""README.md's Python quick start runs as written, on 2 CPU ranks with the CPU FSDP harness in place of the GPUs:
it trains, ``ModelCheckpoint`` writes its checkpoint, and the resumed ``fit`` continues from that checkpoint's
``global_step``. Scenario: ``fsdp_readme_scenarios.py``."""
import pytest

from fsdp_harness.multiprocess import assert_success, run_module
from fsdp_harness.scenario import read_results

SCENARIOS = "tests.strategies.fsdp_readme_scenarios"


@pytest.mark.timeout(300)
def test_readme_quickstart_trains_checkpoints_and_resumes(tmp_path):
    assert_success(run_module(SCENARIOS, ["quickstart", "--out", str(tmp_path)], timeout=240))
    results = read_results(tmp_path, 2)
    for rank, result in enumerate(results):
        first, resumed = result["fits"]
        assert first["strategy"] == resumed["strategy"] == "CPUFullyShardedStrategy", result
        assert first["ckpt_path"] is None and first["start_step"] == 0 and first["end_step"] > 0, (rank, first)
        assert resumed["ckpt_path"] == "checkpoints/last.ckpt", (rank, resumed)
        # the resumed fit started where the checkpoint left off and trained on
        assert resumed["start_step"] == first["end_step"], (rank, resumed)
        assert resumed["end_step"] > resumed["start_step"], (rank, resumed)
    checkpoints = results[0]["checkpoints"]
    # save_last's file and the best-so-far one; the last was rewritten by the resumed fit
    assert "last.ckpt" in checkpoints and len(checkpoints) >= 2, checkpoints
    assert checkpoints["last.ckpt"]["global_step"] == results[0]["fits"][1]["end_step"], checkpoints
    for checkpoint in checkpoints.values():
        assert checkpoint["state_dict"] and checkpoint["optimizer_states"] == 1, checkpoint
