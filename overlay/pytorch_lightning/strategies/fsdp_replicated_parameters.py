"""Replicated parameters: the LightningModule's parameters outside every FSDP instance are broadcast from global
rank 0 at setup and their gradients averaged before each optimizer step, as DDP does. With ``cpu_offload`` they,
and the buffers outside FSDP, are put on the root device, where FairScale computes.

The hooks are ``DDPFullyShardedStrategy``'s ``connect`` and ``optimizer_step`` (through its base class and
checkpointer) and ``configure_ddp``.
"""
# fork-feature: fork/fsdp-sync-replicated-gradients.patch
from typing import Any, Callable, Dict, List, Tuple, TYPE_CHECKING

import torch
from torch.nn import Module
from torch.optim import Optimizer

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.fsdp_introspection import _fsdp_instances
from pytorch_lightning.utilities.checkpoint_errors import _distributed_run
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


def _setup_replicated_parameters(strategy: "DDPFullyShardedStrategy") -> None:
    """Find the parameters of the LightningModule that no FSDP instance manages, make them equal on every
    rank, as DDP does when it wraps a module, and warn about the trainable ones that they are replicated.

    Frozen ones are included: a callback such as ``BackboneFinetuning`` may unfreeze them later. With
    ``cpu_offload``, ``configure_ddp`` leaves the model where it is, and FairScale keeps the parameters it manages
    on the CPU, computing on the root device: what no FSDP instance manages is moved to the root device.
    """
    if strategy.cpu_offload:
        _to_device_outside_fsdp(strategy.lightning_module, strategy.root_device)
        # as ``model_to_device`` does without ``cpu_offload``: ``LightningModule.device`` is where it computes
        strategy.lightning_module._device = strategy.root_device
    _warn_about_split_parameters(strategy)
    managed = {id(p) for m in _fsdp_instances(strategy.lightning_module) for p in m.params}
    named = [(n, p) for n, p in strategy.lightning_module.named_parameters() if id(p) not in managed]
    strategy._replicated_parameters = [p for _, p in named]
    if not named:
        return
    if _distributed_run(strategy.world_size):
        with torch.no_grad():
            for param in strategy._replicated_parameters:
                # collectives run on the root device, where these parameters are (with ``cpu_offload`` too)
                data = param.data.to(strategy.root_device)
                torch.distributed.broadcast(data, src=0, group=strategy.process_group)
                param.data.copy_(data)
    names = [n for n, p in named if p.requires_grad]
    if not names:
        return
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    rank_zero_warn(
        f"{len(names)} trainable parameter(s) of the LightningModule are not managed by any FSDP instance: {shown}."
        " `DDPFullyShardedStrategy` replicates them instead of sharding them: every rank holds a full copy and its"
        " optimizer state, the copies start from global rank 0's values, and their gradients are averaged over"
        " the ranks before each optimizer step. Wrap them with `wrap` in `configure_sharded_model` to shard them."
    )


def _warn_about_split_parameters(strategy: "DDPFullyShardedStrategy") -> None:
    # FairScale's FSDP keeps a parameter shared only between modules inside one FSDP instance: flattening takes
    # it out of the modules of the instance, and a module outside it keeps the original, now a parameter apart
    groups, strategy._parameters_shared_before_wrapping = strategy._parameters_shared_before_wrapping, []
    if not groups:
        return
    module = strategy.lightning_module
    present = {id(m) for m in module.modules()}
    flat_owner: Dict[Tuple[int, str], int] = {}
    for instance in _fsdp_instances(module):
        for flat in instance.params:
            for _, submodule, name in getattr(flat, "_param_infos", []):
                flat_owner[(id(submodule), name)] = id(flat)
            for _, _, submodule, name, _, _ in getattr(flat, "_shared_param_infos", []):
                flat_owner[(id(submodule), name)] = id(flat)
    split = []
    for group in groups:
        owners = {}
        for qualified_name, submodule, name in group:
            if id(submodule) not in present:
                continue  # replaced since, e.g. in ``on_load_checkpoint``
            owner = flat_owner.get((id(submodule), name))
            if owner is None and submodule._parameters.get(name) is not None:
                owner = id(submodule._parameters[name])
            if owner is not None:
                owners.setdefault(owner, qualified_name)
        if len(owners) > 1:
            split.append(" and ".join(f"`{n}`" for n in owners.values()))
    if split:
        rank_zero_warn(
            f"Parameters shared by modules of the LightningModule are no longer shared once wrapped in FSDP:"
            f" {'; '.join(split)}. FairScale's FSDP keeps a parameter shared only between modules inside one"
            " FSDP instance; these are now separate parameters, trained, saved and restored apart, so the model"
            " no longer computes what the unwrapped one does. Wrap the modules that share a parameter in one FSDP"
            " instance, e.g. the whole model with `strategy.model = wrap(strategy.model)`."
        )


def _sync_replicated_gradients(strategy: "DDPFullyShardedStrategy", optimizer: Optimizer) -> None:
    """``DDPFullyShardedStrategy.sync_replicated_gradients`` (see its docstring)."""
    if not strategy._replicated_parameters or not _distributed_run(strategy.world_size):
        return
    replicated = {id(p) for p in strategy._replicated_parameters}
    params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in replicated]
    if not params:
        return
    # A parameter without a gradient on every rank (unused) keeps none, so the optimizer skips it as usual.
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=strategy.root_device)
    torch.distributed.all_reduce(has_grad, group=strategy.process_group)
    params = [p for p, count in zip(params, has_grad.tolist()) if count]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    buckets: Dict[Any, List[torch.nn.Parameter]] = {}
    for param in params:
        if param.grad.is_sparse:
            # e.g. ``nn.Embedding(sparse=True)``: reduced densely, handed back sparse
            dense = param.grad.to_dense().to(strategy.root_device)
            torch.distributed.all_reduce(dense, group=strategy.process_group)
            param.grad = (dense / strategy.world_size).to(param.grad.device).to_sparse()
            continue
        buckets.setdefault((param.grad.device, param.grad.dtype), []).append(param)
    for bucket in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]).to(strategy.root_device)
        torch.distributed.all_reduce(flat, group=strategy.process_group)
        flat /= strategy.world_size
        for param, grad in zip(bucket, flat.split([p.numel() for p in bucket])):
            param.grad.copy_(grad.view_as(param.grad))


def _shared_parameters(module: Module) -> List[List[Tuple[str, Module, str]]]:
    """The parameters that several modules in ``module`` hold (tied weights), each as its users: the qualified name,
    the module and the attribute name."""
    users: Dict[int, List[Tuple[str, Module, str]]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for name, param in submodule._parameters.items():
            if param is not None:
                users.setdefault(id(param), []).append((f"{prefix}.{name}" if prefix else name, submodule, name))
    return [group for group in users.values() if len({(id(m), n) for _, m, n in group}) > 1]


def _to_device_outside_fsdp(module: Module, device: torch.device) -> None:
    """Move what no FSDP instance in ``module`` manages to ``device``: a subtree without FSDP with its own ``to``
    (so that e.g. metrics move their states), a module that holds FSDP instances its own parameters and buffers."""
    if isinstance(module, FullyShardedDataParallel):
        return
    if not _fsdp_instances(module):
        module.to(device)
        return
    for param in module._parameters.values():
        if param is not None:
            # in place: the optimizers hold this parameter
            param.data = param.data.to(device)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer.to(device)
    for child in module.children():
        _to_device_outside_fsdp(child, device)


def _closure_syncing_replicated_gradients(
    strategy: "DDPFullyShardedStrategy", optimizer: Optimizer, closure: Callable[[], Any]
) -> Callable[[], Any]:
    """``closure``, followed by ``strategy.sync_replicated_gradients(optimizer)`` where the LightningModule has
    replicated parameters: the precision plugin runs it before ``on_before_optimizer_step``, gradient clipping and the
    step."""
    if not strategy._replicated_parameters:
        return closure

    def closure_and_sync() -> Any:
        result = closure()
        strategy.sync_replicated_gradients(optimizer)
        return result

    return closure_and_sync
