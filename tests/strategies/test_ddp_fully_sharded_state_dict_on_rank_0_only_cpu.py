"""The multi-GPU body of ``test_ddp_fully_sharded_state_dict_on_rank_0_only.py`` on 2 CPU ranks over gloo.

The exported test file may import only what upstream has, so its 2-CPU-rank run lives here: this module is both
the test and the scenario script it starts
(``python -m tests.strategies.test_ddp_fully_sharded_state_dict_on_rank_0_only_cpu run --out DIR --wrapping wrap``),
running the same body with ``accelerator="cpu"`` and the CPU FSDP harness strategy (``fsdp_harness/cpu_fsdp.py``).
Its harness imports are the three lines below. Both wrappings run in one launch (``cpu_runs``).
"""
import argparse
from typing import Any, Dict

import pytest

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.runner import ScenarioBatch
from fsdp_harness.scenario import main
from tests.strategies.test_ddp_fully_sharded_state_dict_on_rank_0_only import (
    run_fully_sharded_state_dict_on_rank_0_only,
)

MODULE = "tests.strategies.test_ddp_fully_sharded_state_dict_on_rank_0_only_cpu"
def run(args: argparse.Namespace) -> Dict[str, Any]:
    return run_fully_sharded_state_dict_on_rank_0_only(
        str(args.out), args.wrapping, accelerator="cpu", strategy_cls=CPUFullyShardedStrategy,
        save_weights_only=args.weights_only,
    )


WRAPPINGS = ["wrap", "auto_wrap"]
BATCH_TIMEOUT = 480


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory) -> ScenarioBatch:
    batch = ScenarioBatch(MODULE, tmp_path_factory.mktemp("rank_0_only"), timeout=BATCH_TIMEOUT)
    for wrapping in WRAPPINGS:
        batch.add(wrapping, "run", "--wrapping", wrapping)
    return batch


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_fully_sharded_state_dict_on_rank_0_only_cpu(cpu_runs, wrapping):
    rank0, rank1 = cpu_runs.results(wrapping)
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    assert rank0["written"] == 2 and rank1["written"] == 0
    assert rank0["state_dict_keys"] == 8 and rank1["state_dict_keys"] == 0
    assert rank0["restored_keys"] == rank1["restored_keys"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wrapping", choices=["wrap", "auto_wrap"], required=True)
    parser.add_argument("--weights-only", action="store_true", help="save_weights_only for every checkpoint")


if __name__ == "__main__":
    main({"run": run}, add_arguments)
