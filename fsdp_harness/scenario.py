"""Plumbing for multi-process scenario scripts: one ``python -m`` module, many named scenarios.

A script calls :func:`main` with its scenarios; each scenario runs on every rank (Lightning's launcher re-runs the
same command line for ranks >= 1) and returns a JSON-able dict, which is written to ``<out>/rank<N>.json``. The
driving test reads the files back with :func:`read_results`, so a rank that died or hung shows up as missing.

``python -m <module> batch --cases FILE`` runs many scenarios, one after the other, in the same processes (every
rank reads the same list): the launch of the ranks and the imports, most of a small scenario's time, are paid once.
``FILE`` is a JSON list of command lines, each the arguments of one plain run (``<scenario> --out ...``). The batch
stops at the first scenario that raises. Tests build batches with :class:`fsdp_harness.runner.ScenarioBatch`.
"""
import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

Scenario = Callable[[argparse.Namespace], Dict[str, Any]]


def global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"])  # a task of ``srun`` (see ``tests/helpers/fake_srun.py``)
    # Before init (or after teardown) Lightning's launcher has already exported the rank for ranks >= 1.
    return int(os.environ.get("NODE_RANK", 0)) * int(os.environ.get("LOCAL_WORLD_SIZE", 1) or 1) + int(
        os.environ.get("LOCAL_RANK", 0)
    )


BATCH = "batch"
_in_batch = False


def main(scenarios: Dict[str, Scenario], add_arguments: Callable[[argparse.ArgumentParser], None] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(scenarios))
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<N>.json and checkpoints")
    parser.add_argument("--devices", type=int, default=2)
    if add_arguments:
        add_arguments(parser)
    argv = sys.argv[1:]
    if argv[:1] == [BATCH]:
        global _in_batch
        _in_batch = True
        batch = argparse.ArgumentParser()
        batch.add_argument("--cases", type=Path, required=True, help="JSON list of the command lines to run")
        for case_argv in json.loads(batch.parse_args(argv[1:]).cases.read_text()):
            _run(scenarios, parser.parse_args(case_argv))
    else:
        _run(scenarios, parser.parse_args(argv))
    _shut_down_process_group()


def _run(scenarios: Dict[str, Scenario], args: argparse.Namespace) -> None:
    """Run one scenario on this rank; its result goes to ``rank<N>.json``, an exception to ``rank<N>.error``."""
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = scenarios[args.scenario](args)
    except BaseException:
        (args.out / f"rank{global_rank()}.error").write_text(traceback.format_exc())
        raise
    (args.out / f"rank{global_rank()}.json").write_text(json.dumps(result, indent=1, sort_keys=True))


def end_process_groups() -> None:
    """For a scenario that tears the process groups down while every rank is still in it (see
    ``fsdp_collective_fault_scenarios``): all ranks meet, then the groups are destroyed, except in a batch, whose
    next scenario goes on in the same group (a new default group on the same store would meet stale addresses), and
    which :func:`main` shuts down after its last scenario."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        if not _in_batch:
            dist.destroy_process_group()


def _shut_down_process_group() -> None:
    # Lightning 1.6 leaves the process group to interpreter shutdown, where gloo's threads can be torn down in any
    # order ("terminate called without an active exception", exit code -6). Shut it down while everything is alive.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def read_results(out: Path, world_size: int) -> List[Dict[str, Any]]:
    results = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        error = out / f"rank{rank}.error"
        assert path.exists(), f"rank {rank} wrote no result" + (f":\n{error.read_text()}" if error.exists() else "")
        results.append(json.loads(path.read_text()))
    return results


def quiet_trainer_kwargs(root_dir: Path, devices: int, **overrides: Any) -> Dict[str, Any]:
    """Trainer arguments for CPU scenarios: no progress bar, summary, logger or implicit checkpointing, so that a
    scenario's output and files are only what it asks for; ``overrides`` win."""
    kwargs: Dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(root_dir),
    )
    kwargs.update(overrides)
    return kwargs
