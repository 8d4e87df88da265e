"""Scenarios for ``test_scenario_runner.py``: ``python -m tests.fork.runner_scenarios batch --cases FILE``, on one
process (no process group)."""
import argparse
import os
from typing import Any, Dict

from fsdp_harness.scenario import main

# the values of the cases this process ran: a batch runs every case in the same process
_RUNS = []


def echo(args: argparse.Namespace) -> Dict[str, Any]:
    _RUNS.append(args.value)
    return {"value": args.value, "pid": os.getpid(), "earlier": _RUNS[:-1]}


def fail(args: argparse.Namespace) -> Dict[str, Any]:
    raise RuntimeError(f"injected failure {args.value}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--value", default="")


if __name__ == "__main__":
    main({"echo": echo, "fail": fail}, add_arguments)
