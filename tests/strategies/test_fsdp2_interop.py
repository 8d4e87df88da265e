"""A checkpoint of the fork's FSDP strategy loaded by torch FSDP2 (``fully_shard``) on 2 CPU ranks over gloo, through
torch's full state-dict API with ``named_optimizer_state`` and through the converter's DCP directory (scenario in
``fsdp2_interop_scenarios.py``; every case runs in one launch of the ranks)."""
import pytest

from fsdp_harness.runner import run_scenario

SCENARIOS = "tests.strategies.fsdp2_interop_scenarios"
OPTIMIZERS = ["adam", "sgd"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    return run_scenario(SCENARIOS, "fsdp2", out, "--optimizers", ",".join(OPTIMIZERS), timeout=TIMEOUT - 60, grace=30)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("how", ["full", "dcp"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fsdp_checkpoint_loads_into_fsdp2(fsdp2_run, optimizer, how):
    """``full``: ``set_model_state_dict`` / ``set_optimizer_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` with ``named_optimizer_state``; ``dcp``: ``dcp.load`` of the converted directory into
    sharded templates, then ``set_state_dict``. The full state read back equals the file's bit for bit (every
    parameter, every optimizer tensor, the groups' hyperparameters and parameter names), and after one step on the same
    batch it equals the plain model's and plain optimizer's after that step on one process."""
    zero = fsdp2_run[0][optimizer]
    assert zero["param_names"], "the file holds no parameter names"
    case = zero["cases"][how]
    parameters = 5  # ``before`` outside the blocks, two blocks of weight and bias
    tensors = parameters * (1 + {"adam": 3, "sgd": 1}[optimizer])
    for stage in ("loaded", "step"):
        assert case[stage]["ok"], (stage, case[stage])
        assert case[stage]["compared"] == tensors, (stage, case[stage])


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fsdp2_dcp_comes_back_with_from_dcp_and_the_fork_resumes(fsdp2_run, optimizer):
    """FSDP2's own sharded DCP save (after the step above), converted with ``--from dcp``: the file equals FSDP2's
    full state bit for bit (parameters, optimizer tensors, groups), and the fork's FSDP resumes from it on 2 ranks."""
    back = fsdp2_run[0][optimizer]["cases"]["back"]
    assert back["file"]["ok"], back["file"]
    assert back["file"]["compared"] == 5 * (1 + {"adam": 3, "sgd": 1}[optimizer]), back["file"]
    assert back["resumed_step"] > 0
