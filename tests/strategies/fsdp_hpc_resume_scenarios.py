"""A requeued SLURM job with ``DDPFullyShardedStrategy`` on CPU (gloo), every rank a task of
``tests/helpers/fake_srun.py``: run as ``python -m tests.helpers.fake_srun --ntasks 2 -- -m
tests.strategies.fsdp_hpc_resume_scenarios <scenario> --out DIR``; driven by ``test_ddp_fully_sharded_hpc_resume.py``.
"""
import argparse
import os
from pathlib import Path
from typing import Any, Dict, List

import torch

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.scenario import main, quiet_trainer_kwargs
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.plugins.io import TorchCheckpointIO
from tests.helpers.checkpoint_debris import plant_hpc_debris
from tests.helpers.resume_check import state_mismatches


class RecordingCheckpointIO(TorchCheckpointIO):
    """Records the paths of the checkpoints loaded (saving is ``TorchCheckpointIO``'s, so saves still stream)."""

    def __init__(self) -> None:
        self.loaded: List[str] = []

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage) -> Dict[str, Any]:
        self.loaded.append(os.path.basename(str(path)))
        return super().load_checkpoint(path, map_location=map_location)


class RecordStart(Callback):
    """The global step and every rank's full parameters when training starts, i.e. after the restore."""

    def on_train_start(self, trainer: Trainer, pl_module: FSDPModel) -> None:
        self.global_step = trainer.global_step
        self.params = full_parameters(pl_module)  # collective: every rank is here


def _job(root: Path, devices: int, max_steps: int, saves: int = 1) -> Dict[str, Any]:
    """One run of the batch job: Lightning resumes from the newest HPC checkpoint in its root directory, if any,
    trains to ``max_steps`` and saves the next HPC checkpoint (``saves`` times), as its SIGUSR1 handler does before
    the requeue."""
    checkpoint_io, record = RecordingCheckpointIO(), RecordStart()
    strategy = CPUFullyShardedStrategy(checkpoint_io=checkpoint_io)
    kwargs = dict(strategy=strategy, max_steps=max_steps, limit_val_batches=0, callbacks=[record])
    trainer = Trainer(**quiet_trainer_kwargs(root, devices, **kwargs))
    trainer.fit(FSDPModel(width=8, units=2, batches=4))
    result = {
        "environment": type(trainer._accelerator_connector.cluster_environment).__name__,
        "rank": trainer.global_rank,
        "loaded": checkpoint_io.loaded,
        "start_step": record.global_step,
        "mismatches": None,
    }
    if checkpoint_io.loaded:
        saved = torch.load(root / checkpoint_io.loaded[0], map_location="cpu", weights_only=False)
        result["mismatches"] = state_mismatches(record.params, dict(saved["state_dict"]))
    result["saved"] = []
    for _ in range(saves):
        save_path = trainer._checkpoint_connector.hpc_save_path(trainer._weights_save_path_internal)
        trainer.save_checkpoint(save_path)
        result["saved"].append(os.path.basename(save_path))
    return result


def requeue_with_debris(args: argparse.Namespace) -> Dict[str, Any]:
    """Two runs of the job in one folder. The first saves ``hpc_ckpt_1`` and ``hpc_ckpt_2``; then global rank 0
    plants the debris of killed saves and other names (``plant_hpc_debris``) next to them: the second run must
    resume from ``hpc_ckpt_2`` and save ``hpc_ckpt_3``."""
    seed_everything(1)
    root = args.out / "job"
    jobs = [_job(root, args.devices, 2, saves=2)]
    planted: Dict[str, str] = {}
    if int(os.environ["SLURM_PROCID"]) == 0:
        planted = {kind: path.name for kind, path in plant_hpc_debris(root).items()}
    torch.distributed.barrier()
    jobs.append(_job(root, args.devices, 4))
    return {"jobs": jobs, "planted": planted, "files": sorted(p.name for p in root.iterdir())}


if __name__ == "__main__":
    main({"requeue_with_debris": requeue_with_debris})
