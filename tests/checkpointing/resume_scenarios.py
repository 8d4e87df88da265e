"""Multi-process resume scenarios on CPU (2 ranks over gloo), run as ``python -m tests.checkpointing.resume_scenarios``.

Each scenario runs on every rank and returns a JSON-able dict (see :mod:`fsdp_harness.scenario`); the driving tests
are in ``test_resume_multiprocess.py``.
"""
import argparse
from pathlib import Path
from typing import Any, Dict

import torch

from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Trainer, seed_everything
from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
from tests.helpers.mmap_check import is_mapped_from
from tests.helpers.optimizer_models import AdamModel
from tests.helpers.resume_check import RecordOnTrainStart, state_mismatches


def _trainer(args: argparse.Namespace, **overrides: Any) -> Trainer:
    defaults = {"strategy": "ddp", "max_steps": 3, "limit_val_batches": 0}
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**defaults, **overrides}))


class RecordingCheckpointIO(TorchCheckpointIO):
    """Reports whether every tensor of the loaded checkpoint is a view of the file."""

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(path, map_location=map_location)
        tensors = list(checkpoint["state_dict"].values())
        for state in checkpoint["optimizer_states"][0]["state"].values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        self.mapped = [is_mapped_from(t, Path(path)) for t in tensors]
        return checkpoint


def ddp_resume(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit, save (rank 0 streams the file), then resume on every rank through a memory-mapped load."""
    seed_everything(1)
    path = args.out / "model.ckpt"
    trainer = _trainer(args)
    trainer.fit(AdamModel())
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()

    checkpoint_io = RecordingCheckpointIO()
    record = RecordOnTrainStart()
    resumed = AdamModel()
    trainer = _trainer(args, max_steps=5, callbacks=[record], plugins=[checkpoint_io])
    trainer.fit(resumed, ckpt_path=str(path))

    saved = torch.load(path, map_location="cpu", weights_only=False)
    return {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "mapped": checkpoint_io.mapped,
        "model_mismatches": state_mismatches(record.state_dict, saved["state_dict"]),
        "optimizer_mismatches": state_mismatches(record.optimizer_state, saved["optimizer_states"][0]),
        "optimizer_state_tensors": sum(len(s) for s in saved["optimizer_states"][0]["state"].values()),
        "stray_files": sorted(p.name for p in args.out.iterdir() if p.name.endswith(".tmp")),
    }


if __name__ == "__main__":
    main({"ddp_resume": ddp_resume})
