"""Scenarios for ``test_scenario_runner.py`` on 2 ranks forked by ``fsdp_harness.forked_ranks`` (no process group):
``python -m fsdp_harness.forked_ranks --ranks 2 tests.fork.forked_rank_scenarios ...``."""
import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict

from fsdp_harness.scenario import global_rank, main

#: whether Lightning was imported before this module's code ran: by the driver, which imported this module to fork
_DRIVER_IMPORTED_LIGHTNING = "pytorch_lightning.utilities.rank_zero" in sys.modules

from pytorch_lightning.utilities.rank_zero import rank_zero_only  # noqa: E402

def who(args: argparse.Namespace) -> Dict[str, Any]:
    """What a rank knows of itself, and the command line of the process it was forked from."""
    driver = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    return {
        "local_rank": os.environ.get("LOCAL_RANK"),
        "global_rank": global_rank(),
        "rank_zero_only": rank_zero_only.rank,
        "pid": os.getpid(),
        "driver": [part.decode() for part in driver if part],
        "lightning_imported_by_driver": _DRIVER_IMPORTED_LIGHTNING,
        "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
        "driver_pid": os.getppid(),
        "value": os.environ.get("PL_HARNESS_TEST_VALUE"),
    }


def killed_on_rank_0(args: argparse.Namespace) -> Dict[str, Any]:
    """Rank 0 ends by ``args.value`` (a signal's name), rank 1 returns."""
    if global_rank() == 0:
        os.kill(os.getpid(), getattr(signal, args.value))
    return {}


def hang(args: argparse.Namespace) -> Dict[str, Any]:
    """Write this rank's pid to ``pid<rank>``, then sleep past any test's timeout."""
    (args.out / f"pid{global_rank()}").write_text(str(os.getpid()))
    time.sleep(600)
    return {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--value", default="")


if __name__ == "__main__":
    main({"who": who, "killed_on_rank_0": killed_on_rank_0, "hang": hang}, add_arguments)
