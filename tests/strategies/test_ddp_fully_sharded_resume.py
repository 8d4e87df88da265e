"""Resuming ``DDPFullyShardedStrategy`` checkpoints: consolidated optimizer state, restore after sharding, re-sharding
for another world size, and checkpoints of upstream 1.6.5's format (scenarios in ``fsdp_resume_scenarios.py``).

Every scenario runs real FairScale FSDP on CPU processes over gloo (see ``fsdp_harness/cpu_fsdp.py``); the model
creates and wraps its layers in ``configure_sharded_model``. The CPU tests' scenarios run in three launches
(``resume_runs``: 1 rank, 2 ranks, then 1 rank again for the files saved on 2); each test checks its own cases.
"""
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from fsdp_harness.runner import CasePlans, ScenarioBatches
from tests.helpers.runif import RunIf

SCENARIOS = "tests.strategies.fsdp_resume_scenarios"
# the batches of ``resume_runs``, in launch order: world size, timeout and the ranks' extra environment. glibc returns
# freed large blocks to the OS, for ``test_consolidation_memory_on_other_ranks``'s peak of live memory; glibc reads
# it when a process starts, so every batch has it, and the batches can share one driver that forks their ranks.
RETURN_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": "65536"}
BATCHES = {
    "one": (1, 180, RETURN_FREED_BLOCKS),
    "two": (2, 420, RETURN_FREED_BLOCKS),
    "one_after_two": (1, 120, RETURN_FREED_BLOCKS),
}
# a test that reads ``resume_runs`` may be the one that launches every batch
BATCHES_TIMEOUT = sum(timeout for _, timeout, _ in BATCHES.values()) + 60


def batch_name(devices: int, after_two: bool = False) -> str:
    return "one_after_two" if after_two else {1: "one", 2: "two"}[devices]


def new_batches(root: Path) -> ScenarioBatches:
    batches = ScenarioBatches(SCENARIOS, root)
    for name, (devices, timeout, env) in BATCHES.items():
        batches.batch(name, devices, timeout, env)
    return batches


def rank_state(out: Path, rank: int) -> Dict[str, Any]:
    return torch.load(out / f"rank{rank}.pt", map_location="cpu", weights_only=False)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same(actual: Any, expected: Any, what: str, atol: float = 0.0) -> None:
    """Equal tensors, bitwise by default: on CPU the resumed run does exactly the arithmetic of the uninterrupted
    one. ``atol`` allows for GPU kernels that do not guarantee the same rounding from run to run."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual, key=str) == sorted(expected, key=str), what
        for key in expected:
            assert_same(actual[key], expected[key], f"{what}[{key!r}]", atol)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{what}[{i}]", atol)
    elif isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        if atol:
            ok = torch.allclose(actual.double(), expected.double(), rtol=0, atol=atol)
        else:
            ok = torch.equal(actual, expected)
        assert ok, f"{what}: max abs diff {(actual.double() - expected.double()).abs().max().item()}"
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def expected_shards(
    saved: Dict[str, Any], pieces: List[List[str]], world_size: int, rank: int
) -> Dict[int, Dict[str, torch.Tensor]]:
    """This rank's flat shard of a saved (unflattened, name-keyed through ``param_names``) optimizer state, computed
    independently of FairScale: the tensors of the original parameters that each flat parameter holds (``pieces``,
    by optimizer index) are concatenated in order, split into ``world_size`` chunks like ``torch.chunk`` and the
    rank's chunk is zero-padded to the size of the first one, as FSDP shards parameters."""
    index = {name: i for i, name in enumerate(saved["param_names"])}
    shards: Dict[int, Dict[str, torch.Tensor]] = {}
    for flat_id, names in enumerate(pieces):
        states = [saved["state"][index[name]] for name in names if index[name] in saved["state"]]
        if not states:
            continue
        shards[flat_id] = {}
        for key in states[0]:
            values = [state[key] for state in states]
            if not isinstance(values[0], torch.Tensor) or values[0].dim() == 0:
                shards[flat_id][key] = torch.as_tensor(float(values[0]))  # e.g. Adam's step: the same everywhere
                continue
            chunks = list(torch.cat([v.flatten() for v in values]).chunk(world_size))
            chunk = chunks[rank] if rank < len(chunks) else chunks[0].new_empty(0)
            shards[flat_id][key] = torch.nn.functional.pad(chunk, [0, chunks[0].numel() - chunk.numel()])
    return shards


def local_shards(local_state: Dict[str, Any]) -> Dict[int, Dict[str, torch.Tensor]]:
    return {
        flat_id: {name: torch.as_tensor(value).float() if torch.as_tensor(value).dim() == 0 else value
                  for name, value in state.items()}
        for flat_id, state in local_state["state"].items()
    }


def plan_exact_resume(batches: ScenarioBatches, case: str, optimizer: str, *extra: str, devices: int = 2) -> None:
    """Queue the two runs that :func:`check_exact_resume` compares, as ``<case>/straight`` and ``<case>/resumed``."""
    batch = batches.batch(batch_name(devices), devices)
    # 2k steps without stopping; ModelCheckpoint saves after every epoch (k steps), so a save happens mid-run
    straight = batch.add(f"{case}/straight", "fit", "--optimizer", optimizer, "--scheduler", "--epochs", "2", *extra)
    # a fresh Trainer resumes from the checkpoint saved after k steps and trains to 2k
    ckpt = straight / "ckpts" / "epoch=0.ckpt"
    batch.add(
        f"{case}/resumed", "fit", "--optimizer", optimizer, "--scheduler", "--epochs", "2", "--ckpt", ckpt, *extra
    )


def check_exact_resume(
    batches: ScenarioBatches, case: str, devices: int = 2, atol: float = 0.0, streamed: bool = True
) -> None:
    straight, resumed = batches.folder(f"{case}/straight"), batches.folder(f"{case}/resumed")
    results = batches.results(f"{case}/resumed")
    assert [r["global_step"] for r in results] == [8 if devices == 2 else 16] * devices
    # ModelCheckpoint's saves were streamed (``stream_checkpoint``), where they can be
    reasons = [r["stream_reason"] for r in batches.results(f"{case}/straight")]
    assert reasons == [None] * devices if streamed else all(reasons), reasons
    for rank in range(devices):
        expected, actual = rank_state(straight, rank), rank_state(resumed, rank)
        assert_same(actual["params"], expected["params"], f"rank {rank} params", atol)
        assert_same(actual["optim"], expected["optim"], f"rank {rank} optimizer state", atol)
    if devices == 2:
        # the shards differ, so a rank that loaded another rank's shard could not pass the comparison above
        state0, state1 = (rank_state(straight, r)["optim"][0]["state"] for r in range(2))
        assert any(not torch.equal(state0[i][k], state1[i][k]) for i in state0 for k in state0[i] if k != "step")
    # the final checkpoints (model, consolidated optimizer state, scheduler) agree as well
    final_straight = load_checkpoint(straight / "ckpts" / "epoch=1.ckpt")
    final_resumed = load_checkpoint(resumed / "ckpts" / "epoch=1.ckpt")
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        assert_same(final_resumed[key], final_straight[key], key, atol)


# the cases each CPU test reads from ``resume_runs``, queued only for the tests this session runs
PLANS = CasePlans()
queues = PLANS.queues


@pytest.fixture(scope="module")
def resume_runs(request, tmp_path_factory) -> ScenarioBatches:
    batches = new_batches(tmp_path_factory.mktemp("resume"))
    PLANS.queue(request, batches)
    return batches


EXACT = [("sgd", 2), ("adam", 2), ("adam", 1)]


def plan_exact(batches: ScenarioBatches) -> None:
    for optimizer, devices in EXACT:
        plan_exact_resume(batches, f"exact-{optimizer}-{devices}", optimizer, devices=devices)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("optimizer", "devices"), EXACT)
@queues(plan_exact)
def test_exact_resume_matches_uninterrupted_training(resume_runs, optimizer, devices):
    """Upstream 1.6.5 fails this twice over: the model built in ``configure_sharded_model`` cannot be restored
    (``Unexpected key(s) in state_dict``), and, with that fixed, rank 1 resumes with rank 0's optimizer shard."""
    check_exact_resume(resume_runs, f"exact-{optimizer}-{devices}", devices=devices)


def plan_several_outermost(batches: ScenarioBatches) -> None:
    plan_exact_resume(batches, "outermost", "adam", "--wrapping", "auto_wrap", "--min-num-params", "50")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_several_outermost)
def test_exact_resume_with_several_outermost_fsdp_instances(resume_runs):
    """``auto_wrap`` of a container without parameters of its own leaves one outermost FSDP instance per block, as in
    Lightning's FSDP docs; the optimizer state is consolidated and re-sharded per instance."""
    check_exact_resume(resume_runs, "outermost")
    saved = load_checkpoint(resume_runs.folder("outermost/straight") / "ckpts" / "epoch=0.ckpt")
    check_plain_layout(saved)


def check_plain_layout(checkpoint: Dict[str, Any]) -> None:
    """The optimizer state is what a run without FSDP saves: one entry per original parameter, shaped like it, in the
    model's order, named by ``param_names``."""
    saved = checkpoint["optimizer_states"][0]
    params = {name: value for name, value in checkpoint["state_dict"].items() if name in saved["param_names"]}
    assert saved["param_names"] == list(params)
    assert [i for group in saved["param_groups"] for i in group["params"]] == list(range(len(params)))
    for i, state in saved["state"].items():
        assert tuple(state["exp_avg"].shape) == tuple(params[saved["param_names"][i]].shape)


RESHARD = [(2, 2), (2, 1), (1, 2)]


def plan_resume_reshards(
    batches: ScenarioBatches, case: str, save_devices: int, load_devices: int, *extra: str
) -> None:
    save = batches.batch(batch_name(save_devices), save_devices)
    saved = save.add(f"{case}/save", "fit", "--optimizer", "adam", "--epochs", "1", *extra)
    # resume with max_epochs=1: the restored state is reported without training any further
    load = batches.batch(batch_name(load_devices, after_two=load_devices < save_devices), load_devices)
    load.add(f"{case}/load", "fit", "--optimizer", "adam", "--epochs", "1", "--ckpt", saved / "ckpts" / "epoch=0.ckpt",
             *extra)


def plan_reshards(batches: ScenarioBatches) -> None:
    for save_devices, load_devices in RESHARD:
        plan_resume_reshards(batches, f"reshard-{save_devices}-{load_devices}", save_devices, load_devices)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("save_devices", "load_devices"), RESHARD)
@queues(plan_reshards)
def test_resume_reshards_optimizer_state(resume_runs, save_devices, load_devices):
    """Layers created in ``configure_sharded_model`` resume, and every rank gets its slice of the consolidated
    optimizer state, also when the number of devices changes between save and resume."""
    check_resume_reshards(resume_runs, f"reshard-{save_devices}-{load_devices}", load_devices)


def check_resume_reshards(batches: ScenarioBatches, case: str, load_devices: int) -> None:
    results = batches.results(f"{case}/load")
    assert all(r["world_size"] == load_devices for r in results)
    checkpoint = load_checkpoint(batches.folder(f"{case}/save") / "ckpts" / "epoch=0.ckpt")
    # the saved state holds unflattened, full-size tensors, like the model's state dict
    check_plain_layout(checkpoint)
    saved = checkpoint["optimizer_states"][0]
    for rank in range(load_devices):
        state = rank_state(batches.folder(f"{case}/load"), rank)
        assert_same(state["params"], dict(checkpoint["state_dict"]), f"rank {rank} params")
        expected = expected_shards(saved, state["pieces"][0], load_devices, rank)
        assert_same(local_shards(state["optim"][0]), expected, f"rank {rank}")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("save_devices", "load_devices"), RESHARD)
@queues(plan_reshards)
def test_parallel_load_gathers_no_unit(resume_runs, save_devices, load_devices):
    """While the strategy loads the model and optimizer state, no FSDP unit is gathered (FairScale's
    ``_rebuild_full_params``) and no tensor passes through a collective: every rank copies its own shards."""
    for result in resume_runs.results(f"reshard-{save_devices}-{load_devices}/load"):
        assert result["load_bytes_read"] > 0, result  # the load ran, inside the counters
        assert result["load_unit_gathers"] == 0, result
        assert result["load_collective_bytes"] == 0, result["load_collective_calls"]


def share_of_reads(checkpoint: Dict[str, Any], outside: List[str], world_size: int) -> Tuple[float, int]:
    """A rank's share of the bytes of FSDP tensors in ``checkpoint`` (parameters and their optimizer state, S/N), and
    the bytes every rank reads whole: the parameters outside FSDP, buffers, their optimizer state, and scalars."""
    def nbytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    sharded, whole = 0, 0
    for key, value in checkpoint["state_dict"].items():
        if key in outside:
            whole += nbytes(value)
        else:
            sharded += nbytes(value)
    for opt_state in checkpoint["optimizer_states"]:
        for index, state in opt_state["state"].items():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() and opt_state["param_names"][index] not in outside:
                    sharded += nbytes(value)
                elif torch.is_tensor(value):
                    whole += nbytes(value)
    return sharded / world_size, whole


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("save_devices", [2, 1])
@queues(plan_reshards)
def test_parallel_load_reads_each_rank_share(resume_runs, save_devices):
    """Each of 2 ranks reads at most 1.1 x its share of the checkpoint's FSDP tensors (S/N) plus what lies outside
    FSDP, counted at the tensor level (``fsdp_harness/checkpoint_reads.py``), also from a file saved on 1 rank."""
    case = f"reshard-{save_devices}-2"
    checkpoint = load_checkpoint(resume_runs.folder(f"{case}/save") / "ckpts" / "epoch=0.ckpt")
    for result in resume_runs.results(f"{case}/load"):
        share, whole = share_of_reads(checkpoint, result["outside_keys"], 2)
        assert share > 0
        read = result["load_bytes_read"]
        assert 0.9 * share <= read <= 1.1 * share + whole, (read, share, whole)


def plan_test_from_checkpoint(batches: ScenarioBatches) -> None:
    batch = batches.batch("two", 2)
    saved = batch.add("test_from_checkpoint/save", "fit", "--epochs", "1")
    batch.add("test_from_checkpoint/load", "test_from_checkpoint", "--ckpt", saved / "ckpts" / "epoch=0.ckpt")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_test_from_checkpoint)
def test_test_from_checkpoint_restores_sharded_model(resume_runs):
    """Restoring after setup also serves ``trainer.test(ckpt_path=...)``, where no optimizer exists."""
    resume_runs.results("test_from_checkpoint/load")
    checkpoint = load_checkpoint(resume_runs.folder("test_from_checkpoint/save") / "ckpts" / "epoch=0.ckpt")
    for rank in range(2):
        state = rank_state(resume_runs.folder("test_from_checkpoint/load"), rank)
        assert_same(state["params"], dict(checkpoint["state_dict"]), f"rank {rank}")


def plan_consolidate(batches: ScenarioBatches) -> None:
    batches.batch("two", 2).add("consolidate", "consolidate", "--optimizer", "adam")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_consolidate)
def test_full_optimizer_state_only_on_rank_zero(resume_runs):
    rank0, rank1 = resume_runs.results("consolidate")
    assert rank0["full_keys"] == ["param_groups", "param_names", "state"]
    assert rank1["full_keys"] == []
    # consolidating leaves the live optimizer state as it was (FairScale turns ``step`` tensors into ints in place)
    assert rank0["local_state_unchanged"] and rank1["local_state_unchanged"]


LAYOUTS = [
    ("param_groups", "sgd", 2),
    ("reversed", "adam", 2),
    ("no_flatten", "sgd", 2),
    ("no_flatten", "adam", 2),
    ("frozen", "adam", 2),
    ("frozen", "adam", 1),
]


def plan_layouts(batches: ScenarioBatches) -> None:
    for layout, optimizer, devices in LAYOUTS:
        plan_exact_resume(
            batches, f"layout-{layout}-{optimizer}-{devices}", optimizer, "--layout", layout, devices=devices
        )


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("layout", "optimizer", "devices"), LAYOUTS)
@queues(plan_layouts)
def test_exact_resume_with_optimizer_layouts(resume_runs, layout, optimizer, devices):
    """Layouts that upstream 1.6.5 saved (incompletely) resume exactly: several param groups, an optimizer whose
    parameters are not in module order and FSDP instances without optimizer state (frozen blocks, the first one
    included) are consolidated; ``flatten_parameters=False``, which FairScale cannot consolidate, keeps every
    rank's own state."""
    case = f"layout-{layout}-{optimizer}-{devices}"
    # FairScale's consolidated format needs flat parameters: a save with ``flatten_parameters=False`` is not streamed
    check_exact_resume(resume_runs, case, devices=devices, streamed=layout != "no_flatten")
    saved = load_checkpoint(resume_runs.folder(f"{case}/straight") / "ckpts" / "epoch=0.ckpt")["optimizer_states"][0]
    assert ("fsdp_per_rank" in saved) == (layout == "no_flatten")
    if layout == "param_groups":
        lrs = [group["lr"] for group in saved["param_groups"]]
        assert len(lrs) == 2 and lrs[0] * 2 == lrs[1]


def plan_per_rank_world_size(batches: ScenarioBatches) -> None:
    saved = batches.batch("two", 2).add("per_rank/save", "fit", "--layout", "no_flatten", "--epochs", "1")
    batches.batch("one_after_two", 1).add(
        "per_rank/load", "fit", "--layout", "no_flatten", "--epochs", "2", "--ckpt", saved / "ckpts" / "epoch=0.ckpt",
        fails=True,
    )


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_per_rank_world_size)
def test_per_rank_optimizer_state_needs_the_same_world_size(resume_runs):
    result = resume_runs.failure("per_rank/load")
    assert result.returncode != 0
    assert "can only be resumed with 2 processes, not 1" in result.output


OUTSIDE = [("sgd", "sharded", 2), ("adam", "init", 2), ("adam", "sharded", 1)]


def plan_outside(batches: ScenarioBatches) -> None:
    for optimizer, build, devices in OUTSIDE:
        plan_exact_resume(
            batches, f"outside-{optimizer}-{build}-{devices}", optimizer, "--layout", "outside", "--build", build,
            devices=devices,
        )


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize(("optimizer", "build", "devices"), OUTSIDE)
@queues(plan_outside)
def test_exact_resume_with_parameters_outside_fsdp(resume_runs, optimizer, build, devices):
    """Trainable parameters outside FSDP (registered in ``__init__`` and in ``configure_sharded_model``) are
    replicated: their gradients are averaged before each step, so every rank holds the same values, and their
    optimizer state is saved once and restored on every rank. Upstream 1.6.5 trains a different copy per rank."""
    case = f"outside-{optimizer}-{build}-{devices}"
    check_exact_resume(resume_runs, case, devices=devices)
    for run in ("straight", "resumed"):
        states = [rank_state(resume_runs.folder(f"{case}/{run}"), rank) for rank in range(devices)]
        for name in ("before", "after"):
            assert all(torch.equal(s["params"][name], states[0]["params"][name]) for s in states), (run, name)
        assert not torch.equal(states[0]["params"]["before"], torch.linspace(-1, 1, 8))  # it was trained


def plan_replicated_gradients(batches: ScenarioBatches) -> None:
    batches.batch("two", 2).add(
        "replicated_gradients", "fit", "--layout", "outside", "--epochs", "1", "--accumulate", "2", "--clip", "0.001"
    )


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_replicated_gradients)
def test_replicated_gradients_sync_once_per_step_before_clipping(resume_runs):
    """With gradient accumulation and clipping by value, the replicated gradients are averaged once per optimizer
    step, before clipping: the copies stay identical on every rank."""
    for result in resume_runs.results("replicated_gradients"):
        assert result["global_step"] == 2 and result["syncs"] == 2
    states = [rank_state(resume_runs.folder("replicated_gradients"), rank)["params"] for rank in range(2)]
    for name in ("before", "after"):
        assert torch.equal(states[0][name], states[1][name]), name


ON_LOAD_DEVICES = [2, 1]


def plan_upstream_on_load(batches: ScenarioBatches) -> None:
    for devices in ON_LOAD_DEVICES:
        batch = batches.batch(batch_name(devices), devices)
        batch.add(f"on_load-{devices}/stages", "stages", "--recreate-on-load", "--build", "init")
        plan_exact_resume(batches, f"on_load-{devices}", "adam", "--recreate-on-load", "--build", "init",
                          devices=devices)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@pytest.mark.parametrize("devices", ON_LOAD_DEVICES)
@queues(plan_upstream_on_load)
def test_upstream_on_load_checkpoint_pattern(resume_runs, devices):
    """Upstream 1.6.5's FSDP tests re-create the unwrapped layers in ``on_load_checkpoint``. The layers are sharded
    again: in fit, validate, test and predict, and when a fresh Trainer resumes, which resumes exactly."""
    for result in resume_runs.results(f"on_load-{devices}/stages"):
        assert result["sharded_in"] == {"fit": True, "validate": True, "test": True, "predict": True}, result
    check_exact_resume(resume_runs, f"on_load-{devices}", devices=devices)
    for result in resume_runs.results(f"on_load-{devices}/resumed"):
        assert result["sharded_in"] == {"fit": True}


def plan_callbacks_restored(batches: ScenarioBatches) -> None:
    batch = batches.batch("two", 2)
    saved = batch.add("callbacks/save", "fit", "--epochs", "1")
    batch.add("callbacks/load", "fit", "--epochs", "2", "--ckpt", saved / "ckpts" / "epoch=0.ckpt")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_callbacks_restored)
def test_callbacks_are_restored_before_on_fit_start(resume_runs):
    """As with every strategy that restores before setup, callback state (e.g. ``BaseFinetuning``'s param groups)
    is restored before ``on_fit_start`` runs."""
    for result in resume_runs.results("callbacks/load"):
        assert result["restored_at_fit_start"] is True, result


def plan_guard_by_flag(batches: ScenarioBatches) -> None:
    batch = batches.batch("two", 2)
    saved = batch.add("guard_by_flag/save", "fit", "--epochs", "1")
    batch.add(
        "guard_by_flag/load", "fit", "--epochs", "2", "--ckpt", saved / "ckpts" / "epoch=0.ckpt", "--recreate-on-load",
        "--guard-by-flag", fails=True,
    )


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_guard_by_flag)
def test_configure_sharded_model_guarded_by_a_flag_raises_instead_of_running_unsharded(resume_runs):
    result = resume_runs.failure("guard_by_flag/load")
    assert result.returncode != 0
    assert "left 0 FSDP instances instead of 3, so the model would run unsharded" in result.output


def plan_state_device(batches: ScenarioBatches) -> None:
    batch = batches.batch("two", 2)
    args = ("--optimizer", "adam", "--layout", "outside", "--epochs", "1")
    saved = batch.add("state_device/save", "fit", *args)
    batch.add("state_device/load", "fit", *args, "--ckpt", saved / "ckpts" / "epoch=0.ckpt", "--mock-cuda-root")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_state_device)
def test_restored_optimizer_state_stays_on_its_parameters_device(resume_runs):
    """With ``cpu_offload=True`` FairScale keeps the fp32 shards on the CPU while the root device is CUDA; the
    restored optimizer state must stay with its parameter (mocked here: the root device claims to be CUDA)."""
    for result in resume_runs.results("state_device/load"):
        assert result["state_devices_ok"] and all(result["state_devices_ok"]), result


def plan_legacy(batches: ScenarioBatches) -> None:
    batch = batches.batch("two", 2)
    saved = batch.add("legacy/save", "make_legacy", "--scheduler")
    batch.add("legacy/load", "resume_legacy", "--scheduler", "--ckpt", saved / "legacy.ckpt")


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_legacy)
def test_checkpoint_with_rank_zero_optimizer_shard_warns(resume_runs):
    """A checkpoint in upstream 1.6.5's format (rank 0's local optimizer shard) loads the weights, warns, and does
    not hand rank 0's shard to the other ranks."""
    rank0, rank1 = resume_runs.results("legacy/load")
    legacy = load_checkpoint(resume_runs.folder("legacy/save") / "legacy.ckpt")
    assert len(rank0["warnings"]) == 1
    assert "global rank 0's own shard of the FSDP flat parameters" in rank0["warnings"][0]
    assert rank1["warnings"] == []  # rank_zero_warn
    saved_lr = legacy["optimizer_states"][0]["param_groups"][0]["lr"]
    for rank, result in enumerate((rank0, rank1)):
        assert result["lrs"] == [saved_lr]
        state = rank_state(resume_runs.folder("legacy/load"), rank)
        assert_same(state["params"], dict(legacy["state_dict"]), f"rank {rank} params")
        assert state["optim"][0]["state"] == {}


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_exact_resume_matches_uninterrupted_training_multi_gpu(tmp_path, optimizer):
    batches = new_batches(tmp_path)
    plan_exact_resume(batches, "gpu", optimizer, "--accelerator", "gpu")
    check_exact_resume(batches, "gpu", atol=1e-6)


@RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
@pytest.mark.timeout(600)
def test_resume_reshards_optimizer_state_multi_gpu(tmp_path):
    # the body of test_resume_reshards_optimizer_state[2-1] on GPUs
    batches = new_batches(tmp_path)
    plan_resume_reshards(batches, "gpu", 2, 1, "--accelerator", "gpu")
    check_resume_reshards(batches, "gpu", 1)


def plan_consolidation_memory(batches: ScenarioBatches) -> None:
    batches.batch("two", 2).add("memory", "memory", "--optimizer", "adam", "--width", "1024", first=True)


@pytest.mark.timeout(BATCHES_TIMEOUT)
@queues(plan_consolidation_memory)
def test_consolidation_memory_on_other_ranks(resume_runs):
    """Only global rank 0 grows by the full optimizer state; rank 1 needs no more than the gather buffers of one FSDP
    unit (issue bound: 2 x one unit with its optimizer state + 5% of model and optimizer state).

    glibc is told to return freed large blocks to the OS, so that the anonymous-memory peak (``PeakMemory``) measures
    live memory rather than what the allocator keeps cached between the per-unit gathers (``BATCHES``). The case
    runs first in its batch, in processes that ran nothing else.
    """
    rank0, rank1 = resume_runs.results("memory")
    model_mib = 4 * rank0["unit_params_mib"]
    bound = 2 * rank1["unit_with_adam_state_mib"] + 0.05 * (model_mib + rank1["full_adam_state_mib"])
    assert rank1["growth_mib"] <= bound, (rank1, bound)
    assert rank1["growth_mib"] < rank1["full_adam_state_mib"] / 2  # no full copy, not even of one state tensor
    assert rank0["growth_mib"] >= rank0["full_adam_state_mib"]  # the consolidated state lives on rank 0
