"""What one rank reads of a loaded checkpoint, and what passes through its collectives, while the strategy loads it.

The ranks of one host share a page cache, so OS counters (``/proc/<pid>/io``, page faults) cannot tell their reads of a
memory-mapped file apart. :class:`LoadTraffic` counts at the tensor level instead, independently of the code under test,
while it wraps a strategy's ``load_model_state_dict`` and ``load_optimizer_state_dict``:

- a ``TorchDispatchMode`` adds the bytes of every argument of a torch operation that is a view of a tensor of the
  loaded checkpoint, unless the operation is itself a view (the slice of a reshaped tensor reads nothing, the copy of
  the slice reads its bytes) or reads only metadata (``new_empty``). A memory-mapped tensor is paged in only where
  such an operation touches it, so this is what the load reads of the file (an upper bound: a value read twice
  counts twice);
- the ``torch.distributed`` collectives add the bytes of their tensor arguments;
- FairScale's ``_rebuild_full_params`` (the gather of an FSDP unit's full parameters, under ``summon_full_params`` and
  in a forward) counts the units gathered.
"""
import time
from contextlib import ExitStack
from typing import Any, Callable, Dict, Iterator, Set
from unittest import mock

import torch
import torch.distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: the ``torch.distributed`` functions whose tensor arguments count as bytes through collectives
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_reduce",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "reduce",
)


#: torch operations that read only an argument's metadata (shape, dtype, device), not its values
METADATA_ONLY = frozenset(
    {"new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like",
     "full_like", "rand_like", "randn_like", "randint_like", "sym_size", "sym_stride", "sym_numel",
     "sym_storage_offset"}
)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    return (leaf for leaf in tree_leaves(obj) if isinstance(leaf, torch.Tensor))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _ReadsOf(TorchDispatchMode):
    """Adds to ``traffic.bytes_read`` the bytes of each argument of a non-view op whose storage is in ``storages``."""

    def __init__(self, traffic: "LoadTraffic", storages: Set[int]) -> None:
        super().__init__()
        self.traffic, self.storages = traffic, storages

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.overloadpacket.__name__ not in METADATA_ONLY:
            arguments = _tensors((args, kwargs or {}))
            self.traffic.bytes_read += sum(_nbytes(t) for t in arguments if _storage(t) in self.storages)
        return func(*args, **(kwargs or {}))


class LoadTraffic:
    """Counts, for one rank, the bytes read from the checkpoint's tensors (``bytes_read``) and the bytes of the tensor
    arguments of ``torch.distributed`` collectives (``collective_bytes``, per function in ``collective_calls``) and the
    FSDP units gathered (``unit_gathers``) during
    every call of the strategy's ``load_model_state_dict`` and ``load_optimizer_state_dict``; ``seconds`` is the time
    spent in them. Call :meth:`install` once the strategy exists (e.g. in a callback's ``setup``)."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.collective_bytes = 0
        self.collective_calls: Dict[str, int] = {}
        self.unit_gathers = 0
        self.seconds = 0.0

    def install(self, strategy: Any) -> None:
        for name in ("load_model_state_dict", "load_optimizer_state_dict"):
            setattr(strategy, name, self._counting(getattr(strategy, name)))

    def _counting(self, load: Callable[[Any], None]) -> Callable[[Any], None]:
        def counted(checkpoint: Any) -> None:
            storages = {_storage(t) for t in _tensors(dict(checkpoint))} - {0}
            start = time.monotonic()
            try:
                with ExitStack() as stack:
                    for name in COLLECTIVES:
                        if hasattr(torch.distributed, name):
                            original = getattr(torch.distributed, name)
                            stack.enter_context(
                                mock.patch.object(torch.distributed, name, self._collective(name, original))
                            )
                    stack.enter_context(self._counting_unit_gathers())
                    stack.enter_context(_ReadsOf(self, storages))
                    load(checkpoint)
            finally:
                self.seconds += time.monotonic() - start

        return counted

    def _collective(self, name: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.collective_calls[name] = self.collective_calls.get(name, 0) + 1
            self.collective_bytes += sum(_nbytes(t) for t in _tensors((args, kwargs)))
            return original(*args, **kwargs)

        return counted

    def _counting_unit_gathers(self) -> Any:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        original = FullyShardedDataParallel._rebuild_full_params

        def rebuild(instance: FullyShardedDataParallel, *args: Any, **kwargs: Any) -> Any:
            self.unit_gathers += 1
            return original(instance, *args, **kwargs)

        return mock.patch.object(FullyShardedDataParallel, "_rebuild_full_params", rebuild)

    def result(self) -> Dict[str, Any]:
        return {
            "bytes_read": self.bytes_read,
            "collective_bytes": self.collective_bytes,
            "collective_calls": dict(self.collective_calls),
            "unit_gathers": self.unit_gathers,
            "state_seconds": self.seconds,
        }
