"""The streaming decision and placeholders of a streamed FSDP save: before the state is gathered, global rank 0
decides whether this save can be written while the FSDP units are gathered; if so, the state dict and the optimizer
state hold placeholders (``FakeTensor``) for the FSDP parameters and their optimizer state, in the layout the
gathered save writes.

The hooks are ``DDPFullyShardedStrategy``'s ``stream_checkpoint`` argument and ``lightning_module_state_dict``,
and ``CheckpointConnector.save_checkpoint``, which calls :func:`_begin_checkpoint_save` (through the checkpointer).
:mod:`pytorch_lightning.strategies.fsdp_streaming_save` writes the file.
"""
# fork-feature: fork/fsdp-streaming-save.patch
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, TYPE_CHECKING

import torch
from torch.nn import Module
from torch.optim import Optimizer

import pytorch_lightning as pl
from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
from pytorch_lightning.plugins.precision import PrecisionPlugin
from pytorch_lightning.strategies.fsdp_checkpoint_state import _SaveSession
from pytorch_lightning.strategies.fsdp_optimizer_state import _optimizer_state_layout
from pytorch_lightning.strategies.fsdp_introspection import (
    _clean_fsdp_key,
    _flat_parameter_pieces,
    _fsdp_instances,
    _named_fsdp_instances,
)
from pytorch_lightning.utilities.checkpoint_errors import _broadcast_failure, _distributed_run
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.cloud_io import get_filesystem
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from pytorch_lightning.utilities.streamed_checkpoint_file import _streamed_save_available
from pytorch_lightning.utilities.types import _PATH

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


def _begin_checkpoint_save(
    strategy: "DDPFullyShardedStrategy",
    filepath: _PATH,
    weights_only: bool = False,
    storage_options: Optional[Any] = None,
) -> _SaveSession:
    """Called by ``Trainer.save_checkpoint`` on every rank before the checkpoint is put together: the session of
    this save, which says whether it is streamed (see ``stream_checkpoint``); the decision is logged when it
    changes. Collective."""
    reason = _decide_checkpoint_stream(strategy, filepath, storage_options)
    session = _SaveSession(filepath, weights_only, stream=None if reason else _CheckpointStream(weights_only))
    strategy._checkpoint_state.session = session
    if reason is None or strategy.stream_checkpoint:
        _log_checkpoint_stream_decision(strategy, reason)
    return session


def _decide_checkpoint_stream(
    strategy: "DDPFullyShardedStrategy", filepath: _PATH, storage_options: Any
) -> Optional[str]:
    """Global rank 0's reason why this save cannot be streamed, or ``None`` if it can, on every rank."""
    try:
        reason = _reason_checkpoint_cannot_stream(strategy, filepath, storage_options)
    except Exception as ex:
        reason = f"deciding it failed ({type(ex).__name__}: {ex})"
    if _distributed_run(strategy.world_size):
        # rank 0's decision, so that every rank takes the same collectives (a callback may exist on one rank only)
        reason = _broadcast_failure(strategy, reason, src=0)
    return reason


def _log_checkpoint_stream_decision(strategy: "DDPFullyShardedStrategy", reason: Optional[str]) -> None:
    state = strategy._checkpoint_state
    if reason != state.last_stream_reason:
        state.last_stream_reason = reason
        if reason is None:
            rank_zero_info(
                "`DDPFullyShardedStrategy`: global rank 0 writes checkpoints while their FSDP units are"
                " gathered, one at a time (`stream_checkpoint=True`)."
            )
        else:
            rank_zero_info(
                "`DDPFullyShardedStrategy`: the checkpoint is gathered on global rank 0 before it is written,"
                f" not streamed, because {reason}."
            )


def _reason_checkpoint_cannot_stream(
    strategy: "DDPFullyShardedStrategy", filepath: _PATH, storage_options: Optional[Any]
) -> Optional[str]:
    """Why this save cannot be streamed, or ``None`` if it can: the reason of the first check that finds one."""
    instances = _fsdp_instances(strategy.lightning_module)
    checks: List[Callable[[], Optional[str]]] = [
        lambda: _reason_in_configuration(strategy, filepath, storage_options),
        lambda: _reason_in_fsdp_instances(instances, strategy.process_group),
        lambda: _reason_in_optimizer_state(strategy.optimizers, instances),
        lambda: _reason_in_overrides(strategy),
        lambda: _reason_in_custom_state_dicts(strategy),
    ]
    return next((reason for reason in (check() for check in checks) if reason is not None), None)


def _streamed_model_state_dict(strategy: "DDPFullyShardedStrategy", stream: "_CheckpointStream") -> Dict[str, Any]:
    """The LightningModule's state dict as FairScale's ``state_dict()`` builds it, with placeholders instead
    of the parameters of FSDP instances, which are gathered when the checkpoint is written. On global rank 0;
    an empty dict elsewhere."""
    stream.started = True
    if strategy.global_rank != 0:
        stream.model_state_dict = {}
        return stream.model_state_dict
    instances = _fsdp_instances(strategy.lightning_module)
    # for each submodule, its parameters that a flat parameter holds
    owned = _flat_parameter_pieces(instances)
    flat_ids = {id(flat) for instance in instances for flat in instance.params}
    emulated = _modules_with_or_in_fsdp(strategy)
    state_dict: Dict[str, Any] = OrderedDict()
    state_dict._metadata = OrderedDict()  # type: ignore[attr-defined]

    def collect(module: Module, prefix: str, instance: Optional["FullyShardedDataParallel"]) -> None:
        if id(module) not in emulated:
            # no FSDP in or around it: its own ``state_dict``, overrides and hooks included, as when gathered
            module.state_dict(destination=state_dict, prefix=prefix)
            return
        state_dict._metadata[prefix[:-1]] = {"version": module._version}  # type: ignore[attr-defined]
        if isinstance(module, FullyShardedDataParallel):
            instance = module
        for name, param in module._parameters.items():
            if param is not None and id(param) not in flat_ids:
                state_dict[_clean_fsdp_key(prefix + name)] = param.detach()
        for name, shape, dtype, source in owned.get(id(module), []):
            with stream.mode:
                placeholder = torch.empty(shape, dtype=dtype)
            stream.model[_clean_fsdp_key(prefix + name)] = placeholder
            stream.model_sources[_clean_fsdp_key(prefix + name)] = source
            state_dict[_clean_fsdp_key(prefix + name)] = placeholder
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            if instance is not None:
                # as FairScale's state dict has them: in full precision, on the state dict device
                full_precision = instance.mixed_precision and buffer.is_floating_point()
                buffer = buffer.to(
                    instance.state_dict_device, dtype=torch.float32 if full_precision else buffer.dtype, copy=True
                )
            state_dict[_clean_fsdp_key(prefix + name)] = buffer.detach()
        for name, child in module._modules.items():
            if child is not None:
                collect(child, prefix + name + ".", instance)

    collect(strategy.lightning_module, "", None)
    stream.model_state_dict = state_dict
    return state_dict


class _CheckpointStream:
    """The placeholders of one streamed save (see ``DDPFullyShardedStrategy(stream_checkpoint=True)``): tensors
    with a shape and a dtype but no data (``FakeTensor``), for the FSDP parameters and their optimizer state."""

    def __init__(self, weights_only: bool) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.weights_only = weights_only
        self.mode = FakeTensorMode()
        self.started = False
        self.model: Dict[str, torch.Tensor] = {}
        #: for each key of :attr:`model`, the ``id`` of the flat parameter that holds it and the index of its piece
        self.model_sources: Dict[str, Tuple[int, int]] = {}
        self.model_state_dict: Optional[Dict[str, Any]] = None
        self.optimizer_placeholders: Dict[Tuple[Any, ...], torch.Tensor] = {}
        self.optimizer_states: List[Dict[str, Any]] = []
        #: what global rank 0 prepared for the units' writers once it wrote the structure, sent to every rank with
        #: its decision (see ``_save_checkpoint_if_streamed``)
        self.plan: Any = None

    def placeholders(self) -> List[torch.Tensor]:
        return list(self.model.values()) + list(self.optimizer_placeholders.values())


_UNFLATTENED = "FSDP instances have `flatten_parameters=False`"


def _reason_in_fsdp_instances(instances: List["FullyShardedDataParallel"], process_group: Any) -> Optional[str]:
    """What of the FSDP instances keeps the streamed save from laying the state out as FairScale gathers it."""
    layout = _optimizer_state_layout(instances)
    if layout != "consolidated":
        return "the LightningModule has no FSDP instances" if layout == "replicated" else _UNFLATTENED
    if any(m.state_dict_device.type != "cpu" for m in instances):
        return "`state_dict_to_cpu=False`"
    if any(m.no_broadcast_optim_state for m in instances):
        return "FSDP instances have `no_broadcast_optim_state=True`"
    if any(m.process_group is not process_group for m in instances):
        return "FSDP instances have process groups of their own"
    return None


def _reason_in_optimizer_state(
    optimizers: List[Optimizer], instances: List["FullyShardedDataParallel"]
) -> Optional[str]:
    """What of the FSDP parameters' optimizer state the streamed save has no placeholders for."""
    flat_params = {id(p): p for m in instances for p in m.params}
    for optimizer in optimizers:
        for param, buffers in optimizer.state.items():
            for name, value in buffers.items():
                if not torch.is_tensor(value) or id(param) not in flat_params:
                    continue
                if value.dim() == 0 and name != "step":
                    return "the optimizer state has dimensionless tensors other than `step`"
                if value.dim() and value.numel() != param.numel():
                    return f"the optimizer state {name!r} is not shaped like the FSDP parameter shards"
    return None


def _custom_state_dict_methods(modules: Iterable[Module]) -> List[str]:
    """The ``state_dict`` overrides, ``_save_to_state_dict`` overrides, ``get_extra_state`` and state-dict hooks of
    ``modules`` that FairScale's and torch's own machinery does not account for, as ``"`Class.method`"``."""
    from fairscale.nn.misc import FlattenParamsWrapper

    try:
        from torch.distributed._shard.sharded_tensor import state_dict_hook as sharded_tensor_hook
    except ImportError:
        sharded_tensor_hook = None
    found = []
    for module in modules:
        if isinstance(module, (FullyShardedDataParallel, FlattenParamsWrapper)):
            continue  # FairScale's own overrides and hooks, which the streamed save follows
        for name in ("state_dict", "_save_to_state_dict", "get_extra_state"):
            if getattr(type(module), name) is not getattr(Module, name):
                found.append(f"`{type(module).__name__}.{name}`")
        # every LightningModule registers torch's ShardedTensor hook, which only acts on ShardedTensor attributes
        hooks = [h for h in module._state_dict_hooks.values() if h is not sharded_tensor_hook]
        hooks += list(getattr(module, "_state_dict_pre_hooks", {}).values())
        if hooks:
            found.append(f"state-dict hooks of `{type(module).__name__}`")
    return found


def _reason_in_configuration(
    strategy: "pl.strategies.DDPFullyShardedStrategy", filepath: _PATH, storage_options: Optional[Any]
) -> Optional[str]:
    if not strategy.stream_checkpoint:
        return "`stream_checkpoint=False`"
    if not strategy.state_dict_on_rank_0_only:
        return "`state_dict_on_rank_0_only=False`"
    if not _streamed_save_available():
        return f"torch {torch.__version__} cannot write a checkpoint's structure before its data (2.5 can)"
    # also a ``save_checkpoint`` replaced on the instance: whatever it does must see the whole checkpoint
    save = getattr(strategy.checkpoint_io, "save_checkpoint", None)
    if storage_options is not None or getattr(save, "__func__", None) is not TorchCheckpointIO.save_checkpoint:
        return f"the checkpoint is saved by a custom `{type(strategy.checkpoint_io).__name__}.save_checkpoint`"
    try:
        get_filesystem(filepath)
    except (ValueError, ImportError) as ex:
        return f"fsspec cannot open {_redacted(filepath)!r} ({type(ex).__name__})"
    return None


def _reason_in_overrides(strategy: "pl.strategies.DDPFullyShardedStrategy") -> Optional[str]:
    """The strategy methods or hooks that would see the checkpoint without its values."""
    # the class from the strategy, not imported: fully_sharded.py imports this module (through the checkpointer)
    fully_sharded = strategy._fully_sharded_class
    for name in ("lightning_module_state_dict", "optimizer_state"):
        if getattr(type(strategy), name) is not getattr(fully_sharded, name):
            return f"`{type(strategy).__name__}.{name}` is overridden"
    trainer, module = strategy.lightning_module.trainer, strategy.lightning_module
    hooks = [
        f"`{type(module).__name__}.{name}`"
        for name in ("on_save_checkpoint", "on_hpc_save")
        if is_overridden(name, module)
    ]
    hooks += [
        f"`{type(callback).__name__}.on_save_checkpoint`"
        for callback in trainer.callbacks
        if is_overridden("on_save_checkpoint", callback, pl.Callback)
    ]
    if trainer.datamodule is not None and is_overridden("on_save_checkpoint", trainer.datamodule):
        hooks.append(f"`{type(trainer.datamodule).__name__}.on_save_checkpoint`")
    if type(strategy.precision_plugin).on_save_checkpoint is not PrecisionPlugin.on_save_checkpoint:
        hooks.append(f"`{type(strategy.precision_plugin).__name__}.on_save_checkpoint`")
    if hooks:
        # hooks see the whole checkpoint with its values, as before: a streamed save has none of them yet
        return f"{', '.join(hooks)} may read or replace the state's tensors"
    return None


def _reason_in_custom_state_dicts(strategy: "pl.strategies.DDPFullyShardedStrategy") -> Optional[str]:
    emulated = _modules_with_or_in_fsdp(strategy)
    custom = _custom_state_dict_methods(m for m in strategy.lightning_module.modules() if id(m) in emulated)
    if custom:
        # the streamed save lays out the FSDP part of the state dict as FairScale's and torch's own code does
        return f"{', '.join(custom)} may change what the state dict holds"
    return None


def _modules_with_or_in_fsdp(strategy: "pl.strategies.DDPFullyShardedStrategy") -> Set[int]:
    """The ids of the LightningModule's submodules that are, contain or are inside an FSDP instance: their part
    of the state dict comes from FairScale's gather."""
    named = list(strategy.lightning_module.named_modules())
    fsdp_names = [name for name, _ in _named_fsdp_instances(strategy.lightning_module)]
    instances = [m for _, m in _named_fsdp_instances(strategy.lightning_module)]
    modules = {id(m) for instance in instances for m in instance.modules()}
    for name, module in named:
        if any(not name or inner == name or inner.startswith(name + ".") for inner in fsdp_names):
            modules.add(id(module))
    return modules
