"""Streamed FSDP saves (``DDPFullyShardedStrategy(stream_checkpoint=True)``, the default): global rank 0 writes the
checkpoint while the FSDP units and their optimizer state are gathered one at a time.

The file must be the one the gathered save writes (``stream_checkpoint=False``), entry by entry, for models with
nested and auto-wrapped FSDP instances, tied weights, buffers and parameters outside FSDP, with SGD and Adam, full and
weights-only, on 2 ranks and on 1. Scenarios in ``fsdp_stream_scenarios.py`` run real FairScale FSDP on CPU processes
over gloo. Exact resume from streamed checkpoints is checked in ``test_ddp_fully_sharded_resume.py``. The scenarios
run in one launch per world size (``stream_runs``); each test checks its own case.
"""
import pytest
import torch

from fsdp_harness.runner import ScenarioBatches
from tests.helpers.boring_model import BoringModel

SCENARIOS = "tests.strategies.fsdp_stream_scenarios"
EQUALS = [("tied", "wrap", "adam", 2), ("plain", "auto_wrap", "sgd", 2), ("tied", "wrap", "sgd", 1)]
# the batches of ``stream_runs``, in launch order: world size and timeout
BATCHES = {"two": (2, 300), "one": (1, 180)}
BATCHES_TIMEOUT = sum(timeout for _, timeout in BATCHES.values()) + 60


@pytest.fixture(scope="module")
def stream_runs(tmp_path_factory) -> ScenarioBatches:
    batches = ScenarioBatches(SCENARIOS, tmp_path_factory.mktemp("stream"))
    for name, (devices, timeout) in BATCHES.items():
        batches.batch(name, devices, timeout)
    for model, wrapping, optimizer, devices in EQUALS:
        batches.batch({2: "two", 1: "one"}[devices], devices).add(
            f"equals-{model}-{wrapping}-{optimizer}-{devices}", "streamed_equals_gathered",
            "--model", model, "--wrapping", wrapping, "--optimizer", optimizer,
        )
    batches.batch("two", 2).add("hook", "streamed_equals_gathered", "--model", "hook")
    batches.batch("two", 2).add("fails_while_streaming", "fails_while_streaming")
    return batches


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("model", "wrapping", "optimizer", "devices"), EQUALS)
def test_streamed_checkpoint_equals_gathered_checkpoint(stream_runs, model, wrapping, optimizer, devices):
    rank0 = stream_runs.results(f"equals-{model}-{wrapping}-{optimizer}-{devices}")[0]
    for suffix in ("", "-weights"):
        assert rank0[f"stream_reason{suffix}"] is None  # the save was streamed
        assert rank0[f"differences{suffix}"] == []
        assert rank0[f"weights_only_loads{suffix}"] > 0  # ``torch.load(weights_only=True)`` reads the streamed file
    # model and optimizer state tensors, all compared
    assert rank0["tensors"] > rank0["tensors-weights"] >= 8
    assert rank0["temporary_files"] == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_hook_that_reads_the_state_gets_a_gathered_save(stream_runs):
    """``on_save_checkpoint`` sees the values, as before: an overridden hook makes the save gathered, and says so."""
    rank0 = stream_runs.results("hook")[0]
    assert rank0["stream_reason"] == "`ReadsStateOnSave.on_save_checkpoint` may read or replace the state's tensors"
    assert rank0["first_value"][0] == rank0["first_value"][1]
    assert rank0["differences"] == []


def test_state_dict_customisations_are_found():
    """What makes a save gathered when a module that is, holds or is inside an FSDP instance has it: the streamed
    save lays out that part of the state dict as torch's and FairScale's own code does."""
    from pytorch_lightning.strategies.fsdp_stream_decision import _custom_state_dict_methods

    class Override(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):
            return super().state_dict(*args, **kwargs)

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return 1

    hooked = torch.nn.Linear(2, 2)
    hooked._register_state_dict_hook(lambda *args: None)
    modules = [torch.nn.Linear(2, 2), Override(2, 2), Extra(2, 2), hooked]
    assert _custom_state_dict_methods(modules) == [
        "`Override.state_dict`",
        "`Extra.get_extra_state`",
        "state-dict hooks of `Linear`",
    ]
    # every LightningModule registers torch's ShardedTensor hook, which the streamed save allows
    assert _custom_state_dict_methods([BoringModel()]) == []


@pytest.mark.timeout(BATCHES_TIMEOUT)
def test_failure_while_streaming_keeps_the_previous_checkpoint(stream_runs):
    """Rank 0 running out of disk space while writing the file's structure or its units, or rank 1 failing its part
    of a unit's gather: every rank raises the same ``CheckpointError``, the previous file is untouched, no temporary
    file is left, and the next save works (all three in one run)."""
    results = stream_runs.results("fails_while_streaming")
    for fault, fail_rank, cause in [
        ("skeleton", 0, "No space left on device"),
        ("units", 0, "No space left on device"),
        ("optimizer", 1, "injected failure moving optimizer state"),
    ]:
        for result in results:
            assert f"failed on global rank {fail_rank}: " in result[f"raised-{fault}"], (fault, result)
            assert cause in result[f"raised-{fault}"], (fault, result)
        assert results[0][f"unchanged-{fault}"] is True, fault
        assert results[0][f"temporary_files-{fault}"] == [], fault
    assert results[0]["after_loads"] == 8
