"""Restore after sharding: ``DDPFullyShardedStrategy`` restores the checkpoint once ``configure_sharded_model`` has
created and wrapped the layers, and loads the full state dict into the sharded model one FSDP unit at a time.

The hooks are ``DDPFullyShardedStrategy``'s ``load_model_state_dict`` (through its base class), ``setup`` (which
records the FSDP instances), and ``Trainer._run`` (which restores before ``on_fit_start``).
"""
# fork-feature: fork/fsdp-restore-after-sharding.patch
from typing import Any, Callable, List, Mapping, Set, TYPE_CHECKING


from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.fsdp_checkpoint_errors import _new_checkpoint_guard
from pytorch_lightning.strategies.fsdp_guarded_gathers import _gather_units_one_at_a_time
from pytorch_lightning.strategies.fsdp_introspection import (
    _clean_fsdp_key,
    _fsdp_instances,
    _named_fsdp_instances,
    _own_parameters,
)
from pytorch_lightning.trainer.states import TrainerFn
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
    loaded, missing = set(), []
    # ``summon_full_params`` is a collective: the ranks agree before each of its gathers that all of them can take
    # part, so a failure on one rank (copying a unit, or allocating its full parameters inside FairScale) stops
    # every rank before the next gather; the failing rank raises its error, the others ``_PeerFailed``
    guard = _new_checkpoint_guard(strategy)

    def load(prefix: str, instance: "FullyShardedDataParallel") -> None:
        missing.extend(_load_unit(prefix, instance, state_dict, loaded))

    _gather_units_one_at_a_time(instances, guard, strategy._process_group, load)
    guard.settle()
    guard.raise_if_failed()
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


def _load_unit(
    prefix: str, instance: "FullyShardedDataParallel", state_dict: Mapping[str, Any], loaded: Set[str]
) -> List[str]:
    """Copy the values of the gathered parameters of the FSDP instance ``instance`` (not those of the instances
    inside it) from ``state_dict``, adding their keys to ``loaded``; returns the keys it lacks."""
    missing = []
    for key, param in _own_parameters(prefix, instance):
        if key not in state_dict:
            missing.append(key)
            continue
        if param.shape != state_dict[key].shape:
            raise RuntimeError(
                f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)} from"
                f" checkpoint, the shape in current model is {tuple(param.shape)}."
            )
        param.copy_(state_dict[key])
        loaded.add(key)
    return missing
