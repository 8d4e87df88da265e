"""A checkpoint of the fork's FSDP strategy loaded by torch FSDP2 (``fully_shard``) on 2 CPU ranks over gloo, through
torch's full state-dict API with ``named_optimizer_state`` and through the converter's DCP directory (scenario in
``fsdp2_interop_scenarios.py``; every case runs in one launch of the ranks)."""
import pytest

from fsdp_harness.runner import run_scenario

SCENARIOS = "tests.strategies.fsdp2_interop_scenarios"
OPTIMIZERS = ["adam", "sgd"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def fsdp2_out(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2")


@pytest.fixture(scope="module")
def fsdp2_run(fsdp2_out):
    out = fsdp2_out
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


@pytest.fixture(scope="module")
def resumed_on_one_rank(fsdp2_run, fsdp2_out):
    """The files the 2-rank run converted, resumed on 1 rank (the fork's FSDP, and one device)."""
    options = dict(devices=1, timeout=TIMEOUT - 60, grace=30)
    return run_scenario(SCENARIOS, "resume_back", fsdp2_out, "--back", "adam", **options)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("layout", ["converter", "lightning2", "torchtitan", "replicated"])
def test_fsdp2_dcp_comes_back_with_from_dcp_and_resumes(fsdp2_run, resumed_on_one_rank, layout):
    """FSDP2's DCP save (after the step above) in each layout a DCP writer uses, converted with ``--from dcp``: the
    file equals FSDP2's full state bit for bit (parameters, Adam's tensors, groups), and the fork's FSDP and DDP on 2
    ranks, and the fork's FSDP and one device on 1 rank, restore all of it (saved again at once, equal by name).
    ``lightning2`` holds two optimizers (the parameter outside the blocks, the blocks'), resumed by a LightningModule
    with those two; ``replicated`` is torchtitan's layout from a model every rank holds whole: its ``.metadata`` lists
    the model out of order (asserted), which the resume matches by name."""
    back = fsdp2_run[0]["adam"]["cases"]["back"][layout]
    assert back["file"]["ok"], back["file"]
    assert back["file"]["compared"] == 5 * 4, back["file"]
    assert back["model_order"] == (layout != "replicated")
    resumed = {**back["resumed"], **{f"{k}-1": v for k, v in resumed_on_one_rank[0]["adam"][layout].items()}}
    assert sorted(resumed) == ["ddp", "fsdp", "fsdp-1", "single-1"]
    for strategy, case in resumed.items():
        assert case["ok"] and case["compared"] == 5 * 4, (strategy, case)


@pytest.mark.timeout(TIMEOUT)
def test_one_step_after_the_resume_of_a_converted_file_is_the_same_under_each_strategy(fsdp2_run, resumed_on_one_rank):
    """The ``replicated`` file resumed for one more step: the fork's FSDP and DDP on 2 ranks, and the fork's FSDP and
    one device on 1 rank, end with the same parameters and Adam state (within float rounding), which moved."""
    for stepped in (fsdp2_run[0]["adam"]["cases"]["back"]["stepped"], resumed_on_one_rank[0]["adam"]["stepped"]):
        (case,) = stepped.values()
        assert case["compared"] == 5 * 4 and case["max_diff"] < 1e-6 < case["moved"], stepped
