"""Resume scenarios for ``DDPFullyShardedStrategy`` on CPU (gloo), run as
``python -m tests.strategies.fsdp_resume_scenarios``; driven by ``test_ddp_fully_sharded_resume.py``.

Every scenario writes, per rank, ``rank<N>.json`` (a summary) and ``rank<N>.pt`` with the full model parameters
(gathered on every rank) and the rank's *local* optimizer state (its shard), which the tests compare.
"""
import argparse
import itertools
import warnings
from typing import Any, Dict, List, Optional, Tuple
from unittest import mock

import torch
from torch.utils.data import DataLoader

from fsdp_harness.checkpoint_reads import LoadTraffic
from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy
from fsdp_harness.memory_sampler import MIB, PeakMemory
from fsdp_harness.models import _clean_key, FSDPModel, full_parameters, optimizer_parameter_names
from fsdp_harness.scenario import global_rank, main
from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint

WIDTH = 8


def _last_stream_reason(strategy: Any, default: str) -> Optional[str]:
    """Why the strategy's last save was not streamed (``None``: streamed), ``default`` before any save."""
    from pytorch_lightning.strategies.fsdp_checkpoint_state import NOT_DECIDED

    reason = strategy._checkpoint_state.last_stream_reason
    return default if reason is NOT_DECIDED else reason


class ResumeModel(FSDPModel):
    """``FSDPModel`` with data that does not depend on the global RNG, so a resumed run sees exactly the batches the
    uninterrupted run saw, and with the model and optimizer layouts users have.

    Args:
        param_groups: 2 puts the first parameter into a param group of its own, with half the learning rate.
        reverse_params: hand the parameters to the optimizer in reverse module order.
        build: ``"sharded"`` creates the blocks in ``configure_sharded_model``; ``"init"`` creates them in
            ``__init__`` and only wraps them there.
        recreate_on_load: re-create the unwrapped blocks in ``on_load_checkpoint``, as upstream 1.6.5's FSDP tests
            (and users who copied them) do to load a full state dict before ``configure_sharded_model``.
        frozen_blocks: indices of blocks whose parameters are frozen (their FSDP instances have no optimizer state).
        guard_by_flag: ``configure_sharded_model`` wraps only once, guarded by a flag instead of by what is wrapped.
        outside_buffer: a buffer outside FSDP, added to the input.
    """

    def __init__(
        self,
        *args: Any,
        param_groups: int = 1,
        reverse_params: bool = False,
        build: str = "sharded",
        recreate_on_load: bool = False,
        frozen_blocks: Tuple[int, ...] = (),
        guard_by_flag: bool = False,
        outside_buffer: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if outside_buffer:
            self.register_buffer("shift", torch.linspace(0, 1, self.width))
        self.param_groups, self.reverse_params, self.recreate_on_load = param_groups, reverse_params, recreate_on_load
        self.frozen_blocks, self.guard_by_flag, self.wrapped = frozen_blocks, guard_by_flag, False
        if build == "init":
            self.layer = self._blocks()
        self.sharded_in: Dict[str, bool] = {}

    def _blocks(self) -> torch.nn.Sequential:
        blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(self.width, self.width), torch.nn.Tanh())
                                       for _ in range(self.units)])
        for index in self.frozen_blocks:
            blocks[index].requires_grad_(False)
        return blocks

    def configure_sharded_model(self) -> None:
        from fairscale.nn import auto_wrap, wrap

        if self.guard_by_flag and self.wrapped or self.layer is not None and self._layer_sharded():
            return
        self.wrapped = True
        if self.layer is None:
            self.layer = self._blocks()
        if self.wrapping == "wrap":
            self.layer = wrap(torch.nn.Sequential(*[wrap(block) for block in self.layer]))
        else:
            self.layer = auto_wrap(self.layer)
        if self.extra_after and not hasattr(self, "after"):
            self.after = torch.nn.Parameter(torch.linspace(1, 2, self.width), requires_grad=self.train_extras)

    def _layer_sharded(self) -> bool:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        managed = {id(p) for m in self.modules() if isinstance(m, FullyShardedDataParallel) for p in m.params}
        return all(id(p) in managed for p in self.layer.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "shift"):
            x = x + self.shift
        return super().forward(x)

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        if self.recreate_on_load:
            self.layer = self._blocks()

    def on_train_start(self) -> None:
        self.sharded_in["fit"] = self._layer_sharded()

    def on_validation_start(self) -> None:
        self.sharded_in["validate"] = self._layer_sharded()

    def on_test_start(self) -> None:
        self.sharded_in["test"] = self._layer_sharded()

    def on_predict_start(self) -> None:
        self.sharded_in["predict"] = self._layer_sharded()

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch)

    def _loader(self) -> DataLoader:
        data = torch.randn(self.batches * 2 * 2, self.width, generator=torch.Generator().manual_seed(1234))
        return DataLoader(data, batch_size=2)

    def predict_dataloader(self) -> DataLoader:
        return self._loader()

    def configure_optimizers(self):
        if self.param_groups == 1 and not self.reverse_params:
            return super().configure_optimizers()
        params = [p for p in self.parameters() if p.requires_grad]
        if self.reverse_params:
            params = params[::-1]
        two_groups = [{"params": params[:1], "lr": self.lr / 2}, {"params": params[1:]}]
        groups = two_groups if self.param_groups == 2 else params
        optimizer_class = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.SGD
        extra = {} if self.optimizer_name == "adam" else {"momentum": 0.9}
        return optimizer_class(groups, lr=self.lr, **extra)


# --layout NAME: (model arguments, strategy arguments) of the model and optimizer layouts a user may have
LAYOUTS: Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]] = {
    "plain": ({}, {}),
    "param_groups": ({"param_groups": 2}, {}),
    "reversed": ({"reverse_params": True}, {}),
    "no_flatten": ({}, {"flatten_parameters": False}),
    # trainable parameters outside FSDP, registered in ``__init__`` and in ``configure_sharded_model``
    "outside": ({"extra_before": True, "extra_after": True}, {}),
    # FSDP instances without optimizer state, the first one included
    "frozen": ({"units": 4, "frozen_blocks": (0, 1)}, {}),
    # FairScale keeps the FSDP shards on the CPU; parameters and a buffer outside FSDP. One FSDP instance per block:
    # with ``cpu_offload`` FairScale 0.4.13 cannot gather an instance without parameters of its own (``IndexError``
    # in ``summon_full_params``), such as the outer one of nested ``wrap``
    # checkpoints written in the background; parameters outside FSDP, saved from global rank 0 in the training thread
    "async": ({"extra_before": True, "extra_after": True}, {"async_checkpoint": True}),
    "offload": (
        {"extra_before": True, "extra_after": True, "outside_buffer": True, "wrapping": "auto_wrap"},
        {"cpu_offload": True, "min_num_params": 50},
    ),
}


class RestoreOrder(Callback):
    """Records whether the callback state was restored before ``on_fit_start``, as Lightning 1.6.5 does for the
    strategies that restore before setup; ``BaseFinetuning`` rebuilds its param groups there from it."""

    def __init__(self) -> None:
        self.restored = False
        self.restored_at_fit_start: Optional[bool] = None

    def state_dict(self) -> Dict[str, Any]:
        return {"saved": True}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.restored = state_dict["saved"]

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.restored_at_fit_start = self.restored


def make_model(args: argparse.Namespace, **overrides: Any) -> ResumeModel:
    kwargs = dict(
        width=WIDTH, units=2, optimizer=args.optimizer, scheduler=args.scheduler, batches=4, wrapping=args.wrapping,
        build=args.build, recreate_on_load=args.recreate_on_load, guard_by_flag=args.guard_by_flag,
    )
    kwargs.update(LAYOUTS[args.layout][0])
    kwargs.update(overrides)
    return ResumeModel(**kwargs)


def make_trainer(args: argparse.Namespace, max_epochs: int, **trainer_kwargs: Any) -> Trainer:
    strategy_kwargs = {"min_num_params": args.min_num_params, **LAYOUTS[args.layout][1]}
    return Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=CPUFullyShardedStrategy(**strategy_kwargs),
        max_epochs=max_epochs,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        # by value: clipping by norm would need the norm over all shards (FairScale's clip_grad_norm_), which
        # Lightning 1.6 computes per rank in 32-bit precision
        gradient_clip_algorithm="value",
        limit_val_batches=trainer_kwargs.pop("limit_val_batches", 0),
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        # saves at the end of every training epoch, on all ranks (the strategy writes on rank 0)
        callbacks=[
            ModelCheckpoint(dirpath=str(args.out / "ckpts"), save_top_k=-1, filename="{epoch}"), RestoreOrder()
        ],
        default_root_dir=str(args.out),
        **trainer_kwargs,
    )


def local_optimizer_states(trainer: Trainer) -> List[Dict[str, Any]]:
    return [optimizer.state_dict() for optimizer in trainer.optimizers]


def report(args: argparse.Namespace, trainer: Trainer, model: ResumeModel, **extra: Any) -> Dict[str, Any]:
    """Save this rank's full parameters and local optimizer state; return a JSON summary."""
    rank = trainer.global_rank
    params = full_parameters(model)
    optim = local_optimizer_states(trainer)
    pieces = [optimizer_parameter_names(model, optimizer) for optimizer in trainer.optimizers]
    torch.save({"params": params, "optim": optim, "pieces": pieces}, args.out / f"rank{rank}.pt")
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "lrs": [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups],
        # why the last save was not streamed (``stream_checkpoint``), ``None`` if it was
        "stream_reason": _last_stream_reason(trainer.strategy, "no save"),
        # why the last save with ``async_checkpoint=True`` was synchronous, ``None`` if none was
        "synchronous_reason": getattr(trainer.strategy, "_last_synchronous_reason", None),
    }
    result.update(extra)
    return result


def _count_background_saves() -> List[Any]:
    """A list that each save written in the background (``async_checkpoint=True``) appends itself to."""
    from pytorch_lightning.strategies import fsdp_async_checkpoint

    started: List[Any] = []
    original = fsdp_async_checkpoint._BackgroundSave.start

    def start(job: Any) -> None:
        started.append(job)
        original(job)

    fsdp_async_checkpoint._BackgroundSave.start = start
    return started


def fit(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit ``--epochs`` epochs, optionally resuming from ``--ckpt``; ModelCheckpoint saves every epoch.

    Reports how often the replicated gradients were synchronised, on which devices they were averaged, where the
    model's tensors are (see :func:`placement`) and, with ``--mock-cuda-root``, whether every restored optimizer
    state tensor lives on its parameter's device although the root device claims to be CUDA (as with
    ``cpu_offload=True`` on a GPU machine, where FairScale keeps the fp32 shards on the CPU).
    """
    # a different seed per rank, as on a real cluster without a seeded launcher: replicated parameters must still
    # start equal everywhere
    seed_everything(7 + global_rank())
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=args.epochs)
    strategy = trainer.strategy
    syncs, sync_devices = [], set()
    sync = strategy.sync_replicated_gradients

    def counting_sync(optimizer):
        syncs.append(trainer.global_step)
        # the tensors the sync hands to ``all_reduce``
        with mock.patch.object(torch.distributed, "all_reduce", wraps=torch.distributed.all_reduce) as all_reduce:
            result = sync(optimizer)
        sync_devices.update(str(call.args[0].device) for call in all_reduce.call_args_list)
        return result

    strategy.sync_replicated_gradients = counting_sync
    background = _count_background_saves()
    devices_ok: List[bool] = []
    if args.mock_cuda_root:
        load = strategy.load_optimizer_state_dict

        def load_with_cuda_root(checkpoint):
            cuda = mock.PropertyMock(return_value=torch.device("cuda", 0))
            with mock.patch.object(type(strategy), "root_device", new_callable=lambda: cuda):
                load(checkpoint)
            devices_ok.extend(
                value.device == param.device
                for optimizer in trainer.optimizers
                for param, state in optimizer.state.items()
                for value in state.values()
                if torch.is_tensor(value) and value.dim()
            )

        strategy.load_optimizer_state_dict = load_with_cuda_root
    traffic = LoadTraffic()
    traffic.install(strategy)
    trainer.fit(model, ckpt_path=args.ckpt)
    order = next(c for c in trainer.callbacks if isinstance(c, RestoreOrder))
    return report(
        args, trainer, model, syncs=len(syncs), state_devices_ok=devices_ok, sharded_in=model.sharded_in,
        restored_at_fit_start=order.restored_at_fit_start, sync_devices=sorted(sync_devices),
        placement=placement(trainer, model), background_saves=len(background), outside_keys=outside_keys(model),
        **{f"load_{key}": value for key, value in traffic.result().items()},
    )


def outside_keys(model: ResumeModel) -> List[str]:
    """The state-dict keys of the parameters outside FSDP and of all buffers (FSDP does not shard buffers): what
    every rank loads whole."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    inside = {id(p) for m in model.modules() if isinstance(m, FullyShardedDataParallel) for p in m.parameters()}
    names = [n for n, p in model.named_parameters() if id(p) not in inside] + [n for n, _ in model.named_buffers()]
    return sorted(_clean_key(n) for n in names)


def placement(trainer: Trainer, model: ResumeModel) -> Dict[str, Any]:
    """The devices of the root device, the model (``LightningModule.device``), the parameters and buffers outside
    FSDP, and the FSDP shards (where FairScale keeps them: ``_fp32_shard``)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    instances = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    inside = {id(t) for m in instances for t in itertools.chain(m.parameters(), m.buffers())}
    outside = [t for t in itertools.chain(model.parameters(), model.buffers()) if id(t) not in inside]
    return {
        "root": str(trainer.strategy.root_device),
        "module": str(model.device),
        "outside": sorted({str(t.device) for t in outside}),
        # ``_fp32_shard`` exists once FSDP initialised lazily (first forward, summon or load)
        "shards": sorted({str(getattr(p, "_fp32_shard", p).device) for m in instances for p in m.params}),
        "cpu_offload": [m.move_params_to_cpu for m in instances],
    }


def stages(args: argparse.Namespace) -> Dict[str, Any]:
    """Upstream 1.6.5's FSDP test flow: fit, save, then validate, test and predict, the last two from the file."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1, limit_val_batches=2)
    trainer.fit(model)
    path = str(args.out / "stages.ckpt")
    trainer.save_checkpoint(path)
    sharded_in = {}
    trainer.validate(model, verbose=False)
    sharded_in.update(model.sharded_in)
    trainer.test(ckpt_path=path, verbose=False)
    trainer.predict(ckpt_path=path)
    sharded_in.update(model.sharded_in)
    return report(args, trainer, model, sharded_in=sharded_in)


def consolidate(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit one epoch, then call ``optimizer_state`` directly: the full state on rank 0, nothing elsewhere."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    trainer.fit(model)
    before = [{k: dict(v) for k, v in s["state"].items()} for s in local_optimizer_states(trainer)]
    before = [{k: {n: t.clone() for n, t in v.items()} for k, v in s.items()} for s in before]
    full = trainer.strategy.optimizer_state(trainer.optimizers[0])
    after = local_optimizer_states(trainer)[0]["state"]
    unchanged = all(
        type(after[k][n]) is type(t) and torch.equal(torch.as_tensor(after[k][n]), torch.as_tensor(t))
        for k, v in before[0].items()
        for n, t in v.items()
    )
    if trainer.global_rank == 0:
        torch.save(full, args.out / "consolidated.pt")
    return {"rank": trainer.global_rank, "full_keys": sorted(full), "local_state_unchanged": unchanged}


def memory(args: argparse.Namespace) -> Dict[str, Any]:
    """Peak host-memory growth of each rank while the optimizer state is consolidated (Adam, larger layers)."""
    seed_everything(7)
    model = make_model(args, width=args.width, units=4, batches=1)
    trainer = make_trainer(args, max_epochs=1)
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
    trainer.fit(model)
    with PeakMemory() as meter:
        full = trainer.strategy.optimizer_state(trainer.optimizers[0])
    unit_params = args.width * args.width + args.width
    local_state = sum(
        t.numel() * t.element_size() for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim()
    )
    return {
        "rank": trainer.global_rank,
        "growth_mib": meter.result()["peak_extra_mb"],
        "unit_params_mib": unit_params * 4 / MIB,
        "unit_with_adam_state_mib": 3 * unit_params * 4 / MIB,
        "full_adam_state_mib": 2 * 4 * unit_params * 4 / MIB,
        "local_adam_state_mib": local_state / MIB,
        "full_keys": sorted(full),
    }


def test_from_checkpoint(args: argparse.Namespace) -> Dict[str, Any]:
    """``trainer.test(ckpt_path=...)`` restores the weights of a model built in ``configure_sharded_model``."""
    seed_everything(8)  # a different initialisation than the saved model's
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    trainer.test(model, ckpt_path=args.ckpt, verbose=False)
    return report(args, trainer, model)


def make_legacy(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit one epoch and write a checkpoint shaped like upstream 1.6.5's: rank 0's local optimizer shard."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    trainer.fit(model)
    path = args.out / "ckpts" / "epoch=0.ckpt"
    local = local_optimizer_states(trainer)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        checkpoint["optimizer_states"] = local
        torch.save(checkpoint, args.out / "legacy.ckpt")
    trainer.strategy.barrier()
    return report(args, trainer, model)


def resume_legacy(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from a checkpoint of upstream 1.6.5's shape: a warning, the weights load, the optimizer state not."""
    seed_everything(7)
    model = make_model(args)
    trainer = make_trainer(args, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=args.ckpt)
    messages = [str(w.message) for w in caught if "optimizer state" in str(w.message)]
    return report(args, trainer, model, warnings=messages)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--wrapping", default="wrap", choices=["wrap", "auto_wrap"])
    parser.add_argument("--min-num-params", type=int, default=100_000_000, help="of the strategy's auto_wrap policy")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--layout", default="plain", choices=sorted(LAYOUTS))
    parser.add_argument("--build", default="sharded", choices=["sharded", "init"])
    parser.add_argument("--recreate-on-load", action="store_true")
    parser.add_argument("--guard-by-flag", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--mock-cuda-root", action="store_true")


if __name__ == "__main__":
    main(
        {
            "fit": fit,
            "consolidate": consolidate,
            "stages": stages,
            "memory": memory,
            "test_from_checkpoint": test_from_checkpoint,
            "make_legacy": make_legacy,
            "resume_legacy": resume_legacy,
        },
        add_arguments,
    )
