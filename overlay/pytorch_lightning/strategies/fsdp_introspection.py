"""What ``DDPFullyShardedStrategy``'s checkpoints read of FairScale's FSDP: its instances in a module, the pieces of
their flat parameters (and their state-dict keys), the shards each rank holds and the ranges of a flat tensor those
shards cover, which a rank copies from the pieces' full tensors (:func:`_copy_flat_slice`).

The hooks are the fork's FSDP modules, which find FSDP instances and flat-parameter pieces only through these
functions.
"""
# fork-feature: fork/fsdp-restore-after-sharding.patch
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
from torch.nn import Module

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.utilities.checkpoint_verification import _note_read

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


def _flat_parameter_keys(
    prefix: str, instance: "FullyShardedDataParallel", flat: torch.nn.Parameter
) -> Tuple[List[Tuple[str, torch.Size]], List[Tuple[str, torch.Size]]]:
    """The state-dict keys and shapes of the original parameters that the parameter ``flat`` of the FSDP instance
    ``instance`` (under ``prefix`` in the LightningModule) holds, in its order, and those of the names that share one
    of them (tied weights: no piece of their own, the state dict has them under each name). With
    ``flatten_parameters=False`` ``flat`` is one original parameter."""

    def key(*names: str) -> str:
        return _clean_fsdp_key(".".join(name for name in (prefix, *names) if name))

    if not hasattr(flat, "_param_infos"):
        name = next(n for n, p in instance.named_parameters() if p is flat)
        return [(key(name), flat._orig_size)], []
    pieces = [(key(m_name, n), shape) for (m_name, _, n), shape in zip(flat._param_infos, flat._param_shapes)]
    index = {(m_name, n): i for i, (m_name, _, n) in enumerate(flat._param_infos)}
    tied = [
        (key(m_name, n), flat._param_shapes[index[(shared_name, shared_n)]])
        for m_name, shared_name, _, n, _, shared_n in flat._shared_param_infos
    ]
    return pieces, tied


def _shard_range(total: int, rank: int, world_size: int) -> Tuple[int, int, int]:
    """The size of every rank's shard of a flat tensor of ``total`` elements, and where this rank's starts and ends
    in it: FairScale shards as ``torch.flatten(full).chunk(world_size)[rank]``, zero-padded to the first chunk's
    size (a rank past the last chunk holds padding only)."""
    chunk = -(-total // world_size)
    return chunk, min(rank * chunk, total), min((rank + 1) * chunk, total)


def _copy_flat_slice(out: torch.Tensor, tensors: Sequence[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """Fill the 1-d ``out`` with ``torch.cat([t.flatten() for t in tensors]).chunk(world_size)[rank]``, zero-padded as
    FSDP pads its shards, reading only the elements of that chunk of ``tensors``: on a contiguous (memory-mapped)
    tensor the read is a slice of a view, which pages in only its own bytes (a non-contiguous one, from a file
    another program wrote, is copied whole first). Returns ``out``."""
    chunk, start, end = _shard_range(sum(t.numel() for t in tensors), rank, world_size)
    if out.numel() != chunk:
        raise RuntimeError(f"a shard of {chunk} elements does not fit a tensor of {out.numel()}")
    written, offset = 0, 0
    for tensor in tensors:
        lo, hi = max(start - offset, 0), min(end - offset, tensor.numel())
        copied = None
        if lo < hi:
            copied = out[written : written + hi - lo]
            copied.copy_(tensor.reshape(-1)[lo:hi])
            written += hi - lo
        # the CRC-32 of the bytes read, where a load's check is open (``lo >= hi`` notes the record as read in parts)
        _note_read(tensor, lo, hi, copied)
        offset += tensor.numel()
    out[written:].zero_()
    return out


def _flat_slice(tensors: Sequence[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """A new tensor holding :func:`_copy_flat_slice` of ``tensors``, of the first one's dtype and device."""
    chunk, _, _ = _shard_range(sum(t.numel() for t in tensors), rank, world_size)
    return _copy_flat_slice(tensors[0].new_empty(chunk), tensors, rank, world_size)
