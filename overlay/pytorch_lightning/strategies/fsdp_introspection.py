"""What ``DDPFullyShardedStrategy``'s checkpoints read of FairScale's FSDP: its instances in a module, the pieces of
their flat parameters, the shards each rank holds and the ranges of a flat tensor those shards cover.

The hooks are the fork's FSDP modules, which find FSDP instances and flat-parameter pieces only through these
functions.
"""
# fork-feature: fork/fsdp-restore-after-sharding.patch
from typing import Dict, Iterator, List, Tuple

import torch
from torch.nn import Module

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


def _named_fsdp_instances(module: Module) -> List[Tuple[str, "FullyShardedDataParallel"]]:
    """The FSDP instances in ``module`` (nested ones too), outermost first, with their names in it."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]


def _fsdp_instances(module: Module) -> List["FullyShardedDataParallel"]:
    """The FSDP instances in ``module`` (nested ones too), outermost first; ``module`` itself if it is one."""
    return [m for _, m in _named_fsdp_instances(module)]


def _outermost_fsdp_instances(module: Module) -> List["FullyShardedDataParallel"]:
    """The FSDP instances of ``module`` that are not nested inside another FSDP instance."""
    instances = _fsdp_instances(module)
    nested = {id(m) for instance in instances for m in instance.modules() if m is not instance}
    return [m for m in instances if id(m) not in nested]


def _own_parameters(prefix: str, instance: "FullyShardedDataParallel") -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """The parameters of the summoned FSDP instance ``instance`` (under ``prefix`` in the LightningModule) that it
    gathers itself, not those of the FSDP instances inside it, with their state-dict keys. A parameter shared between
    modules of the instance (tied embeddings) is registered under each of its names while summoned, and the state
    dict has it under each: it comes once per name."""
    nested = {id(p) for child in _fsdp_instances(instance) if child is not instance for p in child.parameters()}
    for name, param in instance.named_parameters(remove_duplicate=False):
        if id(param) not in nested:
            yield _clean_fsdp_key(f"{prefix}.{name}" if prefix else name), param


def _clean_fsdp_key(name: str) -> str:
    # FSDP and its FlattenParamsWrapper insert these levels into parameter names; state dict keys omit them
    return ".".join(part for part in name.split(".") if part not in ("_fsdp_wrapped_module", "_fpw_module"))


def _flat_shard(flat: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard of the flat parameter ``flat`` in full precision: with mixed precision FairScale keeps it
    apart from the parameter's data."""
    return getattr(flat, "_fp32_shard", flat.data)


#: A piece of a flat parameter: the ``id`` of the flat parameter and the index of the piece in ``_param_infos``.
_PieceSource = Tuple[int, int]


def _flat_parameter_pieces(
    instances: List["FullyShardedDataParallel"],
) -> Dict[int, List[Tuple[str, torch.Size, torch.dtype, _PieceSource]]]:
    """For each submodule (by ``id``) of ``instances``, the parameters a flat parameter holds for it: their name in
    the submodule, shape, full-precision dtype and the piece of the flat parameter they are (a shared parameter's is
    its source's)."""
    owned: Dict[int, List[Tuple[str, torch.Size, torch.dtype, _PieceSource]]] = {}
    for instance in instances:
        for flat in instance.params:
            dtype = _flat_shard(flat).dtype
            pieces = {(m_name, n): i for i, (m_name, _, n) in enumerate(flat._param_infos)}
            for i, ((_, submodule, name), shape) in enumerate(zip(flat._param_infos, flat._param_shapes)):
                owned.setdefault(id(submodule), []).append((name, shape, dtype, (id(flat), i)))
            for _, shared_name, submodule, name, _, shared_param in flat._shared_param_infos:
                i = pieces[(shared_name, shared_param)]
                owned.setdefault(id(submodule), []).append((name, flat._param_shapes[i], dtype, (id(flat), i)))
    return owned


def _piece_offsets(flat: torch.nn.Parameter) -> List[int]:
    """Where each piece of the flat parameter ``flat`` starts in it, and its end (its number of elements without
    FSDP's padding) last."""
    starts = [0]
    for numel in flat._param_numels:
        starts.append(starts[-1] + numel)
    return starts
