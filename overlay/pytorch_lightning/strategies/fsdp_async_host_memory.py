"""The host-memory check of asynchronous FSDP checkpoints (``DDPFullyShardedStrategy(async_checkpoint=True)``): before
a save copies the ranks' shards into host memory for the background, the ranks check that they have the memory for the
copies they cannot reuse from the previous save (pinned copies as torch's pinned allocator rounds them), under each
host's and each memory cgroup's bound together; if not, the save is synchronous (streamed), with a warning. The copies
are made by :class:`_HostCopies`, here with the check, which counts the buffers it can reuse by the same key.

The hook is :func:`~.fsdp_async_checkpoint._write_streamed_units_in_background`.
"""
# fork-feature: fork/fsdp-async-checkpoint.patch
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import torch

from pytorch_lightning.strategies.fsdp_checkpoint_errors import _host_memory_shortfall
from pytorch_lightning.strategies.fsdp_introspection import _flat_shard, _fsdp_instances, _outermost_fsdp_instances
from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream
from pytorch_lightning.strategies.fsdp_streaming_save import _streamed_optimizer_tensors
from pytorch_lightning.utilities.host_memory import format_bytes, pinned_host_bytes
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile


def _host_copies_fit(
    strategy: Any,
    stream: _CheckpointStream,
    writer: Optional[_StreamedCheckpointFile] = None,
    gathered: bool = True,
) -> bool:
    """Whether the ranks have the host memory for the copies of their shards that this save in the background makes
    (see :func:`_host_copy_need`); if not, global rank 0 warns with what the ranks under the bound that is short need
    and have, and the save is to be synchronous. The same on every rank. Collective (one small all-gather).

    Args:
        strategy: the ``DDPFullyShardedStrategy`` saving.
        stream: the streamed save, whose placeholders say what is copied.
        writer: on global rank 0, the file being written, discarded if the check fails (its all-gather, say).
        gathered: whether global rank 0 receives the units from every rank (``False``: every rank writes its own
            copies into the file, see ``fsdp_parallel_save``).
    """
    try:
        short = _host_memory_shortfall(strategy, *_host_copy_need(strategy, stream, gathered))
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    if short is None:
        return True
    rank_zero_warn(
        "`DDPFullyShardedStrategy(async_checkpoint=True)`: this checkpoint is saved synchronously (streamed, as without"
        f" `async_checkpoint`), because its copies in host memory need about {format_bytes(short.needed)}"
        f" ({short.held}), but {short.bound.description} has only {format_bytes(short.bound.available)} available."
    )
    return False


def _shards_to_copy(
    strategy: Any, weights_only: bool
) -> Tuple[List[torch.nn.Parameter], List[Tuple[Tuple[Any, ...], torch.Tensor, int]]]:
    """What a save in the background copies to host memory, in the order of the placeholders: the flat parameters,
    whose shards it copies, and unless the save is ``weights_only`` the FSDP parameters' optimizer-state tensors, flat,
    with the keys of their placeholders and their number of elements without FSDP's padding."""
    flats = [flat for instance in _fsdp_instances(strategy.lightning_module) for flat in instance.params]
    states = []
    roots = _outermost_fsdp_instances(strategy.lightning_module)
    if not weights_only:
        for index, optimizer in enumerate(strategy.optimizers):
            tensors = _streamed_optimizer_tensors(optimizer, index, roots)
            states += [(key, value.reshape(-1), numel) for _, key, value, numel in tensors]
    return flats, states


def _host_copy_need(strategy: Any, stream: _CheckpointStream, gathered: bool = True) -> Tuple[int, str]:
    """The bytes of host memory this rank allocates for a save in the background, and what for: a copy of each of its
    shards of the FSDP parameters and, unless the save is weights-only, of their optimizer state (the tensors
    ``_copy_shards`` copies) that no copy of the previous save can be reused for, pinned ones as torch's pinned
    allocator rounds them (:func:`~pytorch_lightning.utilities.host_memory.pinned_host_bytes`); on global rank 0 of a
    ``gathered`` save also the largest shard once per rank, which its writer thread receives a unit into."""
    flats, states = _shards_to_copy(strategy, stream.weights_only)
    sources = [_flat_shard(flat) for flat in flats] + [value for _, value, _ in states]
    reusable = Counter(
        _HostCopies._key(b.shape, b.dtype, b.is_pinned()) for b in strategy._checkpoint_state.host_copy_pool
    )
    pageable = pinned = copies = 0
    for source in sources:
        on_gpu = source.device.type == "cuda"
        key = _HostCopies._key(source.shape, source.dtype, on_gpu)
        if reusable[key]:
            reusable[key] -= 1
            continue
        copies += 1
        nbytes = source.numel() * source.element_size()
        if on_gpu:
            pinned += pinned_host_bytes(nbytes)
        else:
            pageable += nbytes
    held = [f"{copies} new copies of its shards, {format_bytes(pageable + pinned)}"]
    if pinned:
        held[0] += f" ({format_bytes(pinned)} pinned, in blocks rounded up to powers of two)"
    receive = 0
    if gathered and strategy.global_rank == 0 and strategy.world_size > 1 and sources:
        receive = strategy.world_size * max(s.numel() * s.element_size() for s in sources)
        held.append(f"{format_bytes(receive)} to receive a unit from every rank")
    return pageable + pinned + receive, " and ".join(held)


class _HostCopies:
    """Copies of tensors in host memory, pinned for tensors on a GPU (the copy is queued on the current stream), into
    the buffers of ``reuse`` where one of the same shape, dtype and pinning is left, else into new ones."""

    def __init__(self, reuse: List[torch.Tensor]) -> None:
        self._free: Dict[Tuple[Any, ...], List[torch.Tensor]] = {}
        for buffer in reuse:
            self._free.setdefault(self._key(buffer.shape, buffer.dtype, buffer.is_pinned()), []).append(buffer)

    @staticmethod
    def _key(shape: torch.Size, dtype: torch.dtype, pinned: bool) -> Tuple[Any, ...]:
        return tuple(shape), dtype, pinned

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.device.type == "cuda"
        free = self._free.get(self._key(tensor.shape, tensor.dtype, pinned))
        if free:
            buffer = free.pop()
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        buffer.copy_(tensor.detach(), non_blocking=pinned)
        return buffer
