"""2-rank CPU scenarios for the benchmark's spilled state dict (:mod:`benchmarks.spill_state_dict`).

``python -m tests.benchmarks.spill_scenarios <scenario> --out DIR``; driven by ``test_spill_state_dict.py``. Each rank
reports what it saw while the checkpoint was being written (through :class:`ProbeIO`) and afterwards:

- ``names_during_write`` / ``names_after``: the files in the spill directory (the spill file must never show up);
- ``spill_maps_during_write`` / ``spill_maps_after``: mappings of spill files in ``/proc/self/maps``, which shows
  that the state dict really is file-backed while it is written, and that nothing of it is left afterwards.
"""
import argparse
import errno
import gc
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from benchmarks.spill_state_dict import SpillFile, SpillStateDictMixin
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.exceptions import CheckpointError
from pytorch_lightning.utilities.types import _PATH
from tests.helpers.cpu_fsdp import CPUFullyShardedStrategy
from tests.helpers.fsdp_models import FSDPModel, full_parameters
from tests.helpers.scenario import main


class SpillStrategy(SpillStateDictMixin, CPUFullyShardedStrategy):
    pass


def spill_maps(directory: Path) -> List[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if f"{directory}{os.sep}.spill-" in line]


class ProbeIO(TorchCheckpointIO):
    def __init__(self, spill_dir: Path, fail: bool) -> None:
        self.spill_dir, self.fail = spill_dir, fail
        self.seen: Dict[str, Any] = {}

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        self.seen = {"names_during_write": sorted(os.listdir(self.spill_dir)),
                     "spill_maps_during_write": len(spill_maps(self.spill_dir))}
        if self.fail:
            raise OSError(errno.ENOSPC, "injected: no space left on device", str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def run(args: argparse.Namespace, fail_write: bool = False) -> Dict[str, Any]:
    seed_everything(1)
    # plain parameters before and after the FSDP stack: entries outside any FSDP unit, which are not spilled
    model = FSDPModel(width=16, units=3, batches=2, extra_before=True, extra_after=True, train_extras=False)
    spill_dir = args.out / "spill"
    spill_dir.mkdir(exist_ok=True)
    io = ProbeIO(spill_dir, fail_write)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=SpillStrategy(checkpoint_dir=str(spill_dir), checkpoint_io=io),
        max_epochs=1, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, default_root_dir=str(args.out),
    )
    trainer.fit(model)
    path = args.out / "model.ckpt"
    error = None
    try:
        trainer.save_checkpoint(path)
    except CheckpointError as ex:
        error = str(ex)
    gc.collect()  # the failed save's traceback held the checkpoint
    result: Dict[str, Any] = dict(
        io.seen, rank=trainer.global_rank, error=error, spilled_bytes=trainer.strategy.last_spilled_bytes,
        names_after=sorted(os.listdir(spill_dir)), spill_maps_after=len(spill_maps(spill_dir)),
    )
    full = full_parameters(model)  # collective
    if trainer.global_rank == 0 and error is None:
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        result["keys_match"] = sorted(state) == sorted(full)
        result["values_equal"] = all(torch.equal(state[k], full[k]) for k in full if k in state)
        result["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    return result


def save(args: argparse.Namespace) -> Dict[str, Any]:
    return run(args)


def write_fails(args: argparse.Namespace) -> Dict[str, Any]:
    """Rank 0's write fails after the state dict was spilled."""
    return run(args, fail_write=True)


def spill_fails(args: argparse.Namespace) -> Dict[str, Any]:
    """Spilling the second unit fails on rank 0 (as a full disk makes ``posix_fallocate`` fail)."""
    original = SpillFile.allocate
    calls = []

    def allocate(self: SpillFile, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return original(self, tensors)

    SpillFile.allocate = allocate
    return run(args)


if __name__ == "__main__":
    main({"save": save, "write_fails": write_fails, "spill_fails": spill_fails})
