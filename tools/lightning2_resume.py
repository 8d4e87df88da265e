"""One LightningModule, run in the fork's environment and in Lightning 2.6's, for ``tools/lightning2_check.sh``.

Lightning 2.6 cannot be installed next to the fork (both are ``pytorch_lightning``), so the check runs this file in
two environments and compares the checkpoints they write. Subcommands:

* ``fit``: fit the module (``--strategy single``, ``fork-fsdp`` = the fork's FairScale FSDP through the CPU harness,
  or ``fsdp`` = Lightning 2.x's ``FSDPStrategy(state_dict_type="full")``), optionally from ``--ckpt``; writes
  ``<out>/last.ckpt``, ``<out>/loaded.pt`` (the optimizer state right after the restore, in ``on_train_start``) and
  ``<out>/result.json``; an exception goes to ``<out>/error.txt`` (exit 1).
* ``emulate-fsdp-full``: what Lightning 2.6's ``FSDPStrategy(state_dict_type="full")`` writes, from a single-device
  file of the same run, for machines where torch's FSDP cannot run.

``tools/lightning2_compare.py`` compares what the fits wrote.

In the fork's environment run it from the repository root as ``python -m tools.lightning2_resume`` (the fork's
``pytorch_lightning/`` and ``fsdp_harness/`` come from the current directory); in Lightning 2.6's as
``python tools/lightning2_resume.py`` from any other directory, where only ``lightning`` is importable.
"""
import argparse
import json
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

try:  # Lightning 2.x
    import lightning.pytorch as pl
except ImportError:  # the fork (1.6.5)
    import pytorch_lightning as pl

WIDTH = 8
UNITS = 4  # FSDP units: one per block, plus the stack that holds them
SAMPLES = 16  # 4 optimizer steps per epoch at a global batch of 4
GLOBAL_BATCH = 4


class Model(pl.LightningModule):
    """``UNITS`` blocks of ``Linear + Tanh``, built in ``__init__`` (so the same keys exist on every strategy), on
    data that does not depend on the global RNG.

    A global batch of ``GLOBAL_BATCH`` is split over the ranks: rank r takes every ``devices``-th sample from the
    r-th, so the ranks' batches of a step together are the single device's batch, and the mean loss averaged over
    the ranks is the single device's mean loss, so a 2-rank step and a 1-device step agree up to rounding.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"``.
        devices: the number of ranks the batch is split over.
    """

    def __init__(self, optimizer: str = "adam", devices: int = 1) -> None:
        super().__init__()
        self.optimizer_name, self.devices = optimizer, devices
        torch.manual_seed(0)
        self.layer = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(UNITS)])
        self.loaded_optimizer_state: Optional[Dict[str, Any]] = None
        self.restored: Dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        prediction = self(batch)
        return nn.functional.mse_loss(prediction, torch.ones_like(prediction))

    def train_dataloader(self) -> DataLoader:
        # Each rank's share is explicit: Lightning 1.6.5's DistributedSampler would shuffle (it does not keep a
        # sequential sampler), and Lightning's sampler replacement is off (see ``fit``).
        data = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(1234))
        return DataLoader(data[self.global_rank :: self.devices], batch_size=GLOBAL_BATCH // self.devices)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_start(self) -> None:
        # What the restore put into the optimizer, before the first step changes it.
        optimizer = self.trainer.optimizers[0]
        self.loaded_optimizer_state = _clone(optimizer.state_dict())
        # What the loops and the callback took from the file: the progress, and ModelCheckpoint's state.
        self.restored = {
            "global_step": self.trainer.global_step,
            "epoch": self.trainer.current_epoch,
            "best_model_path": self.trainer.checkpoint_callback.best_model_path,
        }


class ForkFSDPModel(Model):
    """:class:`Model` under the fork's FairScale FSDP: each block and the stack become FSDP units."""

    def configure_sharded_model(self) -> None:
        from fairscale.nn import wrap
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        if not isinstance(self.layer, FullyShardedDataParallel):
            self.layer = wrap(nn.Sequential(*[wrap(block) for block in self.layer]))


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


def _strategy(name: str) -> Any:
    if name == "single":
        return "auto" if pl.__version__.startswith("2.") else None
    if name == "fork-fsdp":
        from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy

        return CPUFullyShardedStrategy()
    from lightning.pytorch.strategies import FSDPStrategy

    # Lightning 2.6 refuses ``FSDPStrategy`` itself without CUDA (a check of the exact type, in the accelerator
    # connector); torch's FSDP runs on CPU processes over gloo, and a subclass changes nothing else.
    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy(state_dict_type="full", auto_wrap_policy={nn.Sequential}, process_group_backend="gloo")


def _worth_reporting(warning: warnings.WarningMessage) -> bool:
    # what a resume may say about the file: its optimizer state, callback or loop states left behind
    return any(word in str(warning.message) for word in ("optimizer state", "callbacks", "not restored"))


def fit(args: argparse.Namespace) -> Dict[str, Any]:
    model = (ForkFSDPModel if args.strategy == "fork-fsdp" else Model)(args.optimizer, args.devices)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=_strategy(args.strategy),
        max_epochs=args.epochs,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        # a callback with state, to see whether its state crosses
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(args.out / "checkpoints"))],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out),
        **{"use_distributed_sampler" if pl.__version__.startswith("2.") else "replace_sampler_ddp": False},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=str(args.ckpt) if args.ckpt else None)
        trainer.save_checkpoint(str(args.out / "last.ckpt"))
    if trainer.global_rank == 0:
        torch.save(model.loaded_optimizer_state, args.out / "loaded.pt")
    return {
        "lightning": pl.__version__,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "restored": model.restored,
        "warnings": sorted({str(w.message).splitlines()[0][:160] for w in caught if _worth_reporting(w)}),
    }


def emulate_fsdp_full(args: argparse.Namespace) -> None:
    """What Lightning 2.6's ``FSDPStrategy(state_dict_type="full")`` would have written, from a single-device file
    of the same run: its ``optimizer_state`` is the name-keyed full state (``FSDP.optim_state_dict``, which torch's
    ``get_optimizer_state_dict(full_state_dict=True)`` also gives for a plain model) re-keyed by parameter id
    (``FSDP.rekey_optim_state_dict(..., OptimStateKeyType.PARAM_ID, model)``, with ``use_orig_params=True`` the
    plain model's order). For machines where torch's FSDP cannot run (it needs an accelerator)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    checkpoint = torch.load(args.source, map_location="cpu", weights_only=False)
    model = Model(args.optimizer)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    named = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    checkpoint["optimizer_states"] = [
        FullyShardedDataParallel.rekey_optim_state_dict(named, OptimStateKeyType.PARAM_ID, model, optim=optimizer)
    ]
    torch.save(checkpoint, args.destination)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("fit")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--strategy", choices=["single", "fork-fsdp", "fsdp"], default="single")
    run.add_argument("--devices", type=int, default=1)
    run.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    run.add_argument("--epochs", type=int, default=1, help="epochs in all, counting those of --ckpt")
    run.add_argument("--ckpt", type=Path)
    emulate = commands.add_parser("emulate-fsdp-full")
    emulate.add_argument("source", type=Path, help="a Lightning 2.6 single-device checkpoint of the module")
    emulate.add_argument("destination", type=Path)
    emulate.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    args = parser.parse_args()
    if args.command == "emulate-fsdp-full":
        return emulate_fsdp_full(args)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = fit(args)
    except BaseException:
        (args.out / "error.txt").write_text(traceback.format_exc())
        raise
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        # Lightning 1.6 leaves the group to interpreter shutdown, where gloo's threads can abort the process.
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
