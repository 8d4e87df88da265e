"""Real model code under ``DDPFullyShardedStrategy`` on CPU (gloo): tiny random ``transformers`` models, run as
``python -m tests.strategies.fsdp_transformers_scenarios``; driven by ``test_ddp_fully_sharded_transformers.py``.

The models are built from tiny configs (no download, no weights): GPT-2, a causal LM whose ``lm_head.weight`` is
tied to ``transformer.wte.weight``, and ResNet, a vision model with BatchNorm (running statistics and the int64
``num_batches_tracked`` buffer). One scenario run goes through every case of one model, in one pair of processes:
each wrapping (``--wrappings``), with the streamed and with the gathered save. For each case it trains without
stopping, resumes a fresh Trainer (and a freshly initialised model) from the checkpoint saved half way, and writes
per rank what the tests compare: the gathered parameters and buffers and the rank's optimizer shard at the end of
both runs, the warnings that a tie was split, and, on global rank 0, the last checkpoint's state dict and the plain
model's after loading it strictly.
"""
import argparse
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.models import full_parameters
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from pytorch_lightning import LightningModule, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint

# Nothing is downloaded: the models come from configs; this makes an accidental hub access fail instead of hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _last_stream_reason(strategy: Any, default: str) -> Optional[str]:
    """Why the strategy's last save was not streamed (``None``: streamed), ``default`` before any save."""
    from pytorch_lightning.strategies.fsdp_checkpoint_state import NOT_DECIDED

    reason = strategy._checkpoint_state.last_stream_reason
    return default if reason is NOT_DECIDED else reason

BATCHES = 2  # per rank and epoch
# where each model's blocks are, for ``--wrapping block``
BLOCKS = {"gpt2": "transformer.h", "resnet": "resnet.encoder.stages"}
BODY = {"gpt2": "transformer", "resnet": "resnet"}


def build_model(kind: str) -> nn.Module:
    """A tiny, randomly initialised ``transformers`` model; dropout off, so that a resumed run computes exactly what
    the uninterrupted one did (Lightning 1.6 does not checkpoint RNG states)."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
        return model
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=4
    )
    return ResNetForImageClassification(config)


class TransformersModule(LightningModule):
    """A ``transformers`` model that ``configure_sharded_model`` wraps: ``"whole"`` as one FSDP instance
    (``self.model = wrap(self.model)``), ``"block"`` each block in an instance of its own inside one for the rest,
    ``"body"`` only the body (``transformer`` or ``resnet``), which leaves the head outside FSDP: GPT-2's
    ``lm_head.weight`` then stays outside, a parameter apart from ``transformer.wte.weight``.

    ``sync_batchnorm`` converts the BatchNorm layers to ``SyncBatchNorm`` before they are wrapped, as
    docs/fsdp-models.md shows (``Trainer(sync_batchnorm=True)`` converts after ``configure_sharded_model``, too late
    for FSDP).
    """

    def __init__(self, kind: str, wrapping: str, sync_batchnorm: bool = False) -> None:
        super().__init__()
        self.kind, self.wrapping, self.sync_batchnorm = kind, wrapping, sync_batchnorm
        self.model = build_model(kind)

    def configure_sharded_model(self) -> None:
        from fairscale.nn import wrap
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        if isinstance(self.model, FullyShardedDataParallel):
            return
        if self.sync_batchnorm:
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        if self.wrapping == "body":
            setattr(self.model, BODY[self.kind], wrap(getattr(self.model, BODY[self.kind])))
            return
        if self.wrapping == "block":
            blocks = self.model.get_submodule(BLOCKS[self.kind])
            for index, block in enumerate(blocks):
                blocks[index] = wrap(block)
        self.model = wrap(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "gpt2":
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss
        images, labels = batch
        return self.model(pixel_values=images, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        # independent of the global seed: the resumed run sees the batches the uninterrupted one saw; each rank gets
        # its own half (Lightning's DistributedSampler), so BatchNorm statistics differ per rank
        generator = torch.Generator().manual_seed(1234)
        size = BATCHES * 2 * 2
        if self.kind == "gpt2":
            data = TensorDataset(torch.randint(0, 64, (size, 8), generator=generator))
        else:
            data = TensorDataset(torch.randn(size, 3, 16, 16, generator=generator), torch.arange(size) % 4)
        return DataLoader(data, batch_size=2)


def fit(
    args: argparse.Namespace, out: Path, wrapping: str, stream: bool, init_seed: int, ckpt: Optional[str] = None
) -> Tuple[Trainer, List[str]]:
    """Fit 2 epochs, from ``ckpt`` if given, with the model initialised from ``init_seed``; save every epoch.
    Returns the Trainer and the warnings that wrapping split a shared parameter."""
    # also the seed of the DistributedSampler's shuffle, which the resumed run must share
    seed_everything(7)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = TransformersModule(args.model, wrapping, sync_batchnorm=args.sync_batchnorm)
    trainer = Trainer(
        **quiet_trainer_kwargs(
            out,
            args.devices,
            accelerator=args.accelerator,
            strategy=CPUFullyShardedStrategy(stream_checkpoint=stream),
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=str(out / "ckpts"), save_top_k=-1, filename="{epoch}")],
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=ckpt)
    return trainer, [str(w.message) for w in caught if "no longer shared" in str(w.message)]


def final_state(trainer: Trainer) -> Dict[str, Any]:
    """This rank's gathered parameters and buffers (every name of a shared parameter), and its optimizer shard."""
    state = full_parameters(trainer.lightning_module, remove_duplicate=False)
    optimizer = trainer.optimizers[0].state_dict()
    return {"params": state, "optim": {"state": optimizer["state"], "param_groups": optimizer["param_groups"]}}


def loads_into_plain_model(kind: str, path: Path) -> Dict[str, Any]:
    """Load the checkpoint's state dict into the plain model, strictly; return both state dicts."""
    state_dict = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    plain = build_model(kind)
    plain.load_state_dict({k[len("model."):]: v for k, v in state_dict.items()}, strict=True)
    return {"saved": dict(state_dict), "plain": {f"model.{k}": v for k, v in plain.state_dict().items()}}


def cases(args: argparse.Namespace) -> Dict[str, Any]:
    """Every wrapping, streamed and gathered: an uninterrupted run of 2 epochs and a run resumed from the checkpoint
    of its first epoch. Writes ``<case>.rank<N>.pt`` (see the module docstring)."""
    result: Dict[str, Any] = {"rank": global_rank(), "cases": []}
    for wrapping in args.wrappings:
        for stream in (True, False):
            case = f"{wrapping}-{'streamed' if stream else 'gathered'}"
            straight, straight_warnings = fit(args, args.out / case / "straight", wrapping, stream, init_seed=1)
            ckpt = args.out / case / "straight" / "ckpts" / "epoch=0.ckpt"
            resumed, resumed_warnings = fit(
                args, args.out / case / "resumed", wrapping, stream, init_seed=2, ckpt=str(ckpt)
            )
            record: Dict[str, Any] = {
                "straight": final_state(straight),
                "resumed": final_state(resumed),
                # why ModelCheckpoint's saves were not streamed, ``None`` if they were
                "stream_reason": _last_stream_reason(straight.strategy, "not streamed"),
                "global_steps": [straight.global_step, resumed.global_step],
                "split_warnings": straight_warnings + resumed_warnings,
            }
            if straight.global_rank == 0:
                last = args.out / case / "straight" / "ckpts" / "epoch=1.ckpt"
                record["file"] = loads_into_plain_model(args.model, last)
            torch.save(record, args.out / f"{case}.rank{straight.global_rank}.pt")
            result["cases"].append(case)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(BLOCKS), required=True)
    parser.add_argument("--wrappings", nargs="+", choices=["block", "whole", "body"], default=["block", "whole"])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--sync-batchnorm", action="store_true", help="SyncBatchNorm, which needs GPUs")


if __name__ == "__main__":
    main({"cases": cases}, add_arguments)
