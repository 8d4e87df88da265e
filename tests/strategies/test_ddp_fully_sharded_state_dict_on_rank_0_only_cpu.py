"""The multi-GPU body of ``test_ddp_fully_sharded_state_dict_on_rank_0_only.py`` on 2 CPU ranks over gloo.

The exported test file may import only what upstream has, so its 2-CPU-rank run lives here: this module is both the test
and the scenario script it starts (``python -m tests.strategies.test_ddp_fully_sharded_state_dict_on_rank_0_only_cpu run
--out DIR --wrapping wrap``), running the same body with ``accelerator="cpu"`` and the CPU FSDP harness strategy
(``fsdp_harness/cpu_fsdp.py``). Its harness imports are the three lines below.
"""
import argparse
from typing import Any, Dict

import pytest

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.multiprocess import assert_success, run_module
from fsdp_harness.scenario import main, read_results
from tests.strategies.test_ddp_fully_sharded_state_dict_on_rank_0_only import (
    run_fully_sharded_state_dict_on_rank_0_only,
)

MODULE = "tests.strategies.test_ddp_fully_sharded_state_dict_on_rank_0_only_cpu"
def run(args: argparse.Namespace) -> Dict[str, Any]:
    return run_fully_sharded_state_dict_on_rank_0_only(
        str(args.out), args.wrapping, accelerator="cpu", strategy_cls=CPUFullyShardedStrategy,
        save_weights_only=args.weights_only,
    )


def _run_on_2_cpu_ranks(out, wrapping: str, *extra: str):
    return run_module(MODULE, ["run", "--out", str(out), "--wrapping", wrapping, *extra], timeout=240)


@pytest.mark.timeout(540)
@pytest.mark.parametrize("wrapping", ["wrap", "auto_wrap"])
def test_fully_sharded_state_dict_on_rank_0_only_cpu(tmp_path, wrapping):
    assert_success(_run_on_2_cpu_ranks(tmp_path / "full", wrapping))
    rank0, rank1 = read_results(tmp_path / "full", 2)
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    assert rank0["written"] == 2 and rank1["written"] == 0
    assert rank0["state_dict_keys"] == 8 and rank1["state_dict_keys"] == 0
    assert rank0["restored_keys"] == rank1["restored_keys"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wrapping", choices=["wrap", "auto_wrap"], required=True)
    parser.add_argument("--weights-only", action="store_true", help="save_weights_only for every checkpoint")


if __name__ == "__main__":
    main({"run": run}, add_arguments)
