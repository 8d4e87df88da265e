"""The FairScale interposer (``strategies/fsdp_guarded_gathers.py``), which replaces FairScale's module global
``dist`` during a checkpoint's gathers: it checks FairScale's shape at setup, guards a collective however ``group``
is passed, refuses a second thread, and checks that it puts back what it replaced.

The shape check runs here against FairScale's real module and against module objects that lack one piece each; the
rest runs in real saves on 2 CPU ranks (``tests/strategies/fsdp_interposer_scenarios.py``, one launch).
"""
import threading
import types
from pathlib import Path
from typing import Any

import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
import pytest
import torch

from fsdp_harness.cpu_fsdp import _FreshCPUOutputsDist
from fsdp_harness.multiprocess import assert_success, run_module
from fsdp_harness.scenario import read_results
from pytorch_lightning.strategies.fsdp_guarded_gathers import (
    _agreeing_fairscale_collectives,
    _check_fairscale_interposable,
    _fairscale_interposer_problems,
    _group_argument,
)
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard
from pytorch_lightning.utilities.exceptions import MisconfigurationException

FAKE_VERSION = "0.9.9-shape-test"


def fairscale_like(**changes: Any) -> types.SimpleNamespace:
    """FairScale's FSDP module as an object of its own, with ``changes`` applied (``None`` removes a name)."""
    module = types.SimpleNamespace(**vars(fsdp_module))
    for name, value in changes.items():
        if value is None:
            delattr(module, name)
        else:
            setattr(module, name, value)
    return module


def fsdp_class_without(name: str) -> type:
    """A ``FullyShardedDataParallel`` subclass without the method ``name`` (it is ``None`` there)."""
    return type("FullyShardedDataParallel", (fsdp_module.FullyShardedDataParallel,), {name: None})


class _OldFSDP(fsdp_module.FullyShardedDataParallel):
    """An FSDP without ``volatile`` and whose ``__init__`` never sets ``training_state``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.mixed_precision = False
        self.move_params_to_cpu = False

    def summon_full_params(self, recurse: bool = True) -> None:
        pass


@pytest.mark.parametrize(
    ("changes", "missing"),
    [
        ({"dist": None}, "the module global `dist`"),
        ({"dist": types.SimpleNamespace(all_reduce=None, broadcast_object_list=None)}, "`dist.all_gather`"),
        ({"TrainingState": types.SimpleNamespace(IDLE=0)}, "`TrainingState.SUMMON_FULL_PARAMS`"),
        ({"FullyShardedDataParallel": None}, "the class `FullyShardedDataParallel`"),
        (
            {"FullyShardedDataParallel": fsdp_class_without("_free_fp16_param_shard")},
            "`FullyShardedDataParallel._free_fp16_param_shard`",
        ),
        ({"FullyShardedDataParallel": _OldFSDP}, "the `volatile` parameter of `FullyShardedDataParallel.summon"),
        ({"FullyShardedDataParallel": _OldFSDP}, "`FullyShardedDataParallel.training_state` (set in `__init__`)"),
    ],
)
def test_shape_check_names_what_fairscale_lacks_and_its_version(changes, missing):
    module = fairscale_like(**changes)
    problems = _fairscale_interposer_problems(module)
    assert any(problem.startswith(missing) for problem in problems), problems
    with pytest.raises(MisconfigurationException, match=f"The installed FairScale {FAKE_VERSION} lacks") as err:
        _check_fairscale_interposable(module, version=FAKE_VERSION)
    assert missing in str(err.value)


def test_shape_check_passes_installed_fairscale_and_the_cpu_harness_global():
    assert _fairscale_interposer_problems(fsdp_module) == []
    # the CPU harness replaces the same global with a proxy of its own (fsdp_harness/cpu_fsdp.py)
    assert _fairscale_interposer_problems(fairscale_like(dist=_FreshCPUOutputsDist(fsdp_module.dist))) == []


def test_torch_collectives_wrapped_by_others_still_pass_and_bind_their_group(monkeypatch):
    """A test's fault injection, a profiler or the CPU harness may replace ``torch.distributed.gather`` with a wrapper
    that takes ``*args``: the check and the positional-``group`` binding read torch's own function instead."""
    original = torch.distributed.gather
    monkeypatch.setattr(torch.distributed, "gather", lambda *args, **kwargs: original(*args, **kwargs))
    assert _fairscale_interposer_problems(fsdp_module) == []
    group = object()
    assert _group_argument("gather", (torch.zeros(1), None, 0, group), {}) is group


def _guard() -> _CollectiveGuard:
    return _CollectiveGuard(lambda failed: [])


def test_a_second_thread_is_refused_and_the_global_is_left_alone():
    original, seen = fsdp_module.dist, {}

    def second() -> None:
        try:
            with _agreeing_fairscale_collectives(_guard(), None):
                seen["entered"] = True
        except RuntimeError as error:
            seen["error"] = str(error)

    with _agreeing_fairscale_collectives(_guard(), None):
        proxy = fsdp_module.dist
        thread = threading.Thread(target=second)
        thread.start()
        thread.join()
        assert fsdp_module.dist is proxy
        with _agreeing_fairscale_collectives(_guard(), None):  # the same thread may nest
            assert fsdp_module.dist is not proxy
        assert fsdp_module.dist is proxy
    assert "already guarded in another thread" in seen.get("error", ""), seen
    assert fsdp_module.dist is original
    thread = threading.Thread(target=second)  # and once the first is done, another thread may guard
    thread.start()
    thread.join()
    assert seen.get("entered") and fsdp_module.dist is original


def test_a_global_swapped_meanwhile_is_reported_and_the_original_put_back():
    original = fsdp_module.dist
    with pytest.raises(RuntimeError, match="module global `dist` was replaced by 'foreign' while a checkpoint"):
        with _agreeing_fairscale_collectives(_guard(), None):
            fsdp_module.dist = "foreign"
    assert fsdp_module.dist is original
    with _agreeing_fairscale_collectives(_guard(), None):  # not left active by the failed exit
        pass


def test_a_global_swapped_while_the_block_raises_lets_the_block_error_through():
    # a Ctrl-C (or the block's own error) must stay what it is, not become the swap's RuntimeError
    original = fsdp_module.dist
    with pytest.raises(KeyboardInterrupt):
        with _agreeing_fairscale_collectives(_guard(), None):
            fsdp_module.dist = "foreign"
            raise KeyboardInterrupt
    assert fsdp_module.dist is original


@pytest.mark.timeout(420)
def test_interposer_in_real_saves(tmp_path: Path) -> None:
    """One 2-rank launch: a positional ``group`` is guarded (the rank that did not run out of memory stops instead of
    waiting in the collective), a second thread is refused, a swapped global is reported, and a FairScale lacking a
    method fails ``fit`` at setup, naming its version."""
    result = run_module(
        "tests.strategies.fsdp_interposer_scenarios",
        ["interposer", "--out", str(tmp_path)],
        timeout=300,
        grace=30,
        env={"PL_CHECKPOINT_TIMEOUT": "30"},
    )
    assert_success(result)
    results = read_results(tmp_path, 2)
    for rank, cases in enumerate(results):
        for layout in ("streamed", "gathered"):
            thread = cases[f"thread-{layout}"]
            assert thread["raised"] and "already guarded in another thread" in thread["message"], thread
            assert thread["global_kept"] and not thread["save"]["raised"], thread
            swap = cases[f"swap-{layout}"]
            assert swap["raised"] and "CheckpointError" in swap["mro"], swap
            assert "module global `dist` was replaced by" in swap["message"], swap
            assert swap["restored"] and not swap["retry"]["raised"], swap
            for fail_rank in (0, 1):
                case = cases[f"positional-{layout}-rank{fail_rank}"]
                assert case["positional_calls"] > 0, case
                assert case["raised"] and "MemoryError" in case["mro"], case
                assert f"failed on global rank {fail_rank}: MemoryError" in case["message"], case
                assert case["seconds"] < 60 and not case["retry"]["raised"], case
        setup = cases["setup"]
        assert setup["raised"] and setup["mro"][0] == "MisconfigurationException", setup
        assert f"FairScale {fsdp_module_version()} lacks" in setup["message"], setup
        assert "`FullyShardedDataParallel._free_fp16_param_shard`" in setup["message"], setup
        assert setup["trained_steps"] == 0, (rank, setup)


def fsdp_module_version() -> str:
    import fairscale

    return fairscale.__version__
