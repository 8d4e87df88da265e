"""Restore after sharding: ``DDPFullyShardedStrategy`` restores the checkpoint once ``configure_sharded_model`` has
created and wrapped the layers, and loads the full state dict into the sharded model in parallel: every rank copies
into its own shard of each FSDP flat parameter the elements of that shard's range of the (memory-mapped) full tensors,
reading only those. No unit is gathered and no collective carries tensor data.

The hooks are ``DDPFullyShardedStrategy``'s ``load_model_state_dict`` (through its base class), ``setup`` (which
records the FSDP instances), and ``Trainer._run`` (which restores before ``on_fit_start``).
"""
# fork-feature: fork/fsdp-restore-after-sharding.patch
from typing import Any, Callable, List, Mapping, Set, TYPE_CHECKING

import torch

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.fsdp_introspection import (
    _clean_fsdp_key,
    _copy_flat_slice,
    _flat_parameter_keys,
    _flat_shard,
    _fsdp_instances,
    _named_fsdp_instances,
)
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.checkpoint_verification import _note_share
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


def _reshard_lightning_module(strategy: "DDPFullyShardedStrategy") -> None:
    rank_zero_info(
        "`on_load_checkpoint` replaced layers that `configure_sharded_model` had wrapped in FSDP: calling"
        " `configure_sharded_model` again to shard the new layers before the checkpoint is loaded into them."
    )
    trainer = strategy.lightning_module.trainer
    before = len(strategy._sharded_modules)
    trainer._call_configure_sharded_model()
    strategy._sharded_modules = _fsdp_instances(strategy.lightning_module)
    if len(strategy._sharded_modules) < before:
        raise MisconfigurationException(
            "`on_load_checkpoint` replaced layers that `configure_sharded_model` had wrapped in FSDP, and calling"
            f" `configure_sharded_model` again left {len(strategy._sharded_modules)} FSDP instances instead of"
            f" {before}, so the model would run unsharded. The checkpoint is restored after"
            " `configure_sharded_model`: make it wrap layers that are not wrapped yet (for example, test"
            " `isinstance(layer, FullyShardedDataParallel)` rather than a flag), or stop re-creating the layers in"
            " `on_load_checkpoint`."
        )
    if trainer.state.fn == TrainerFn.FITTING and strategy._layer_sync:
        strategy.model = strategy._layer_sync.apply(strategy.model)
    strategy.configure_ddp()


def _load_model_state_dict(
    strategy: "DDPFullyShardedStrategy",
    checkpoint: Mapping[str, Any],
    load_unsharded: Callable[[Mapping[str, Any]], None],
) -> None:
    """``DDPFullyShardedStrategy.load_model_state_dict`` (see its docstring); ``load_unsharded`` loads a LightningModule
    without FSDP instances."""
    current = {id(m) for m in _fsdp_instances(strategy.lightning_module)}
    if any(id(m) not in current for m in strategy._sharded_modules):
        _reshard_lightning_module(strategy)
    module = strategy.lightning_module
    instances = _named_fsdp_instances(module)
    if not instances:
        return load_unsharded(checkpoint)
    state_dict = checkpoint["state_dict"]
    loaded: Set[str] = set()
    missing: List[str] = []
    # No collective: every rank copies its own shards, so a failure on one rank (an allocation, a read of the file)
    # leaves the others nowhere to wait; ``CheckpointConnector.restore_model`` raises it on every rank
    for prefix, instance in instances:
        for flat in instance.params:
            missing.extend(_load_shard(prefix, instance, flat, state_dict, loaded))
    flat_ids = {id(p) for _, instance in instances for p in instance.params}
    flat_names = {_clean_fsdp_key(n) for n, p in module.named_parameters() if id(p) in flat_ids}
    rest = {key: value for key, value in state_dict.items() if key not in loaded}
    result = module.load_state_dict(rest, strict=False)
    missing += [key for key in result.missing_keys if _clean_fsdp_key(key) not in flat_names]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing},"
            f" unexpected keys {result.unexpected_keys}."
        )


def _load_shard(
    prefix: str,
    instance: "FullyShardedDataParallel",
    flat: torch.nn.Parameter,
    state_dict: Mapping[str, Any],
    loaded: Set[str],
) -> List[str]:
    """Copy this rank's shard of the parameter ``flat`` of the FSDP instance ``instance`` (under ``prefix``) from the
    full tensors in ``state_dict`` of the original parameters it holds, reading only the shard's elements, and add
    their keys (and those of the names tied to them) to ``loaded``; returns the keys it lacks, and copies nothing
    then. The shard's range comes from the full tensors, so a file saved at any world size loads."""
    pieces, tied = _flat_parameter_keys(prefix, instance, flat)
    present = [(key, shape) for key, shape in pieces + tied if key in state_dict]
    for key, shape in present:
        if state_dict[key].shape != shape:
            raise RuntimeError(
                f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)} from"
                f" checkpoint, the shape in current model is {tuple(shape)}."
            )
    loaded.update(key for key, _ in present)
    missing = [key for key, _ in pieces + tied if key not in state_dict]
    if not missing:
        with torch.no_grad():
            _copy_flat_slice(
                _flat_shard(flat).view(-1), [state_dict[key] for key, _ in pieces], instance.rank, instance.world_size
            )
        # a tied name's own record (the streamed save writes one per name) is marked loaded without being read: the
        # load's check reads it once, each rank its share
        for key, _ in tied:
            _note_share(state_dict[key], instance.rank, instance.world_size)
    return missing
