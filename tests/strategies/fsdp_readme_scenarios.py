"""README.md's Python quick start, run as written on CPU FSDP (2 ranks over gloo):
``python -m tests.strategies.fsdp_readme_scenarios quickstart --out DIR``.

The ```` ```python ```` blocks of README.md run in order as one script, in ``DIR`` (the quick start's relative
``checkpoints/`` lands there), with the CPU harness standing in for the GPUs it is written for: the harness's
:class:`~fsdp_harness.cpu_fsdp.CPUFullyShardedStrategy` is what ``DDPFullyShardedStrategy`` names (it overrides only
the strategy's CUDA check), and ``accelerator="gpu"`` reads ``accelerator="cpu"``. Every ``Trainer.fit`` is recorded
(its ``ckpt_path``, the ``global_step`` it started and ended at), and global rank 0 reads the checkpoints it left.

Every rank writes ``<out>/rank<N>.json``; driven by ``test_ddp_fully_sharded_readme.py``.
"""
import argparse
import os
from pathlib import Path
from typing import Any, Dict, List

import torch

import pytorch_lightning.strategies
from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.scenario import global_rank, main
from pytorch_lightning import Callback, Trainer

README = Path(__file__).resolve().parents[2] / "README.md"
#: What the quick start says for GPUs, and what the CPU harness runs instead.
ACCELERATOR_GPU, ACCELERATOR_CPU = 'accelerator="gpu"', 'accelerator="cpu"'


def python_blocks(markdown: str) -> str:
    """The ```` ```python ```` fenced blocks of ``markdown`` as one script, every other line blank, so that a
    traceback's line numbers are README.md's."""
    lines, inside = [], False
    for line in markdown.splitlines():
        fence = line.strip() in ("```python", "```")
        keep = inside and not fence
        if fence:
            inside = line.strip() == "```python" and not inside
        lines.append(line if keep else "")
    return "\n".join(lines) + "\n"


def quickstart_source(markdown: str) -> str:
    """The Python blocks as one script for CPU ranks."""
    source = python_blocks(markdown)
    if ACCELERATOR_GPU not in source:
        raise AssertionError(f"README.md's Python blocks no longer say {ACCELERATOR_GPU}: update this scenario")
    return source.replace(ACCELERATOR_GPU, ACCELERATOR_CPU)


class _FitRecorder(Callback):
    def __init__(self) -> None:
        self.start_step = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        # after the checkpoint, if any, was restored
        self.start_step = trainer.global_step


def _record_fits(fits: List[Dict[str, Any]]) -> None:
    """Make every ``Trainer.fit`` append its ``ckpt_path`` and the ``global_step`` it started and ended at."""
    original_fit = Trainer.fit

    def fit(trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        recorder = _FitRecorder()
        trainer.callbacks.append(recorder)
        original_fit(trainer, *args, **kwargs)
        fits.append(
            {
                "ckpt_path": kwargs.get("ckpt_path"),
                "start_step": recorder.start_step,
                "end_step": trainer.global_step,
                "strategy": type(trainer.strategy).__name__,
            }
        )

    Trainer.fit = fit


def _checkpoints(folder: Path) -> Dict[str, Dict[str, Any]]:
    found = {}
    for path in sorted(folder.glob("*.ckpt")):
        checkpoint = torch.load(path, weights_only=True)
        found[path.name] = {
            "global_step": checkpoint["global_step"],
            "state_dict": sorted(checkpoint["state_dict"]),
            "optimizer_states": len(checkpoint["optimizer_states"]),
        }
    return found


def quickstart(args: argparse.Namespace) -> Dict[str, Any]:
    source = quickstart_source(README.read_text())
    fits: List[Dict[str, Any]] = []
    _record_fits(fits)
    # The harness's override: ``from pytorch_lightning.strategies import DDPFullyShardedStrategy`` gets it.
    pytorch_lightning.strategies.DDPFullyShardedStrategy = CPUFullyShardedStrategy
    os.chdir(args.out)
    namespace: Dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, str(README), "exec"), namespace)
    result: Dict[str, Any] = {"fits": fits}
    if global_rank() == 0:
        result["checkpoints"] = _checkpoints(args.out / "checkpoints")
    return result


if __name__ == "__main__":
    main({"quickstart": quickstart})
