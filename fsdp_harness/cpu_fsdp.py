"""Run Lightning's ``DDPFullyShardedStrategy`` with real FairScale FSDP on CPU processes over gloo.

This is test and benchmark support, not part of the fork's package. FairScale 0.4.13 FSDP assumes CUDA in a few
places that are pure plumbing (streams and device defaults); everything else runs for real: Lightning's Trainer and
DDP launcher, the patched strategy, FairScale's sharding, all-gathers and reduce-scatters over gloo, and the
checkpoint files. Exactly what is emulated, and why:

1. ``DDPFullyShardedStrategy.setup_distributed`` refuses non-CUDA devices. :class:`CPUFullyShardedStrategy`
   skips only that check and defaults ``process_group_backend`` to ``"gloo"``.
2. FSDP's compute device falls back to ``cuda`` (``_get_default_cuda_device``) when parameters are on CPU;
   here it returns ``cpu``.
3. The root FSDP instance leaves ``_streams`` empty without CUDA, but ``_post_reduction_hook`` asserts that the
   current stream is ``_streams["post_backward"]``. All streams become the one shared CPU stream
   (``torch.cpu.current_stream()``), and ``torch.cuda.current_stream`` returns that same stream.
4. ``torch.cuda.stream(...)`` becomes a null context, ``torch.cuda.synchronize`` and the CPU stream's
   ``synchronize`` (which FSDP calls with ``move_grads_to_cpu``) no-ops, and ``Tensor.record_stream`` a no-op for
   CPU tensors (CPU work is synchronous, so there is nothing to order).
5. gloo's ``_reduce_scatter_base``/``_all_gather_base`` reject FairScale's 2-D inputs, so
   ``enable_nccl_base_collectives`` is turned off in FSDP and in the reduce-scatter bucketer; FairScale then uses
   the list-based collectives, which gloo supports.
6. ``gather_full_optim_state_dict`` all-gathers every optimizer state tensor of an FSDP instance into one reused
   buffer and keeps ``[x.cpu() for x in buffer]`` on rank 0; with CUDA tensors ``.cpu()`` copies, on CPU it
   returns the buffer itself, so every state tensor (``exp_avg``, ``exp_avg_sq``) would alias the last one
   gathered. While ``_gather_optim_state`` runs, the ``all_gather`` FSDP calls gathers CPU tensors into fresh
   output tensors instead (elsewhere FSDP gathers into views of the full parameter, which must stay).
7. With ``cpu_offload=True`` FairScale pins the CPU shards and gradients (``Tensor.pin_memory``), which needs an
   accelerator; without one, pinning a CPU tensor returns it as it is (pinned memory only speeds up copies to a
   GPU). Everything else of the offload runs as on a GPU machine, except that the root device is the CPU too.

:func:`install` applies 2-5 and 7 once per process; the strategy calls it, so a script only has to use the strategy.
On a machine with CUDA nothing is patched and the strategy behaves exactly like its parent.
"""
import contextlib
from typing import Any, Optional

import torch

from pytorch_lightning.strategies import DDPFullyShardedStrategy
from pytorch_lightning.strategies.ddp import DDPStrategy

_INSTALLED = False


def _cpu_stream() -> Any:
    return torch.cpu.current_stream()


def install() -> None:
    """Patch the CUDA-only plumbing of FairScale FSDP for CPU processes (idempotent, no-op with CUDA)."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    import fairscale.internal.reduce_scatter_bucketer as bucketer
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp

    fsdp.enable_nccl_base_collectives = False
    bucketer.enable_nccl_base_collectives = False
    fresh_dist = _FreshCPUOutputsDist(fsdp.dist)
    fsdp.dist = fresh_dist
    original_gather_optim_state = fsdp.FullyShardedDataParallel._gather_optim_state

    def _gather_optim_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        fresh_dist.active = True
        try:
            return original_gather_optim_state(self, *args, **kwargs)
        finally:
            fresh_dist.active = False

    fsdp.FullyShardedDataParallel._gather_optim_state = _gather_optim_state

    original_default_device = fsdp._get_default_cuda_device

    def _default_device(module: torch.nn.Module) -> torch.device:
        device = original_default_device(module)
        return torch.device("cpu") if device.type == "cuda" else device

    fsdp._get_default_cuda_device = _default_device

    original_setup_streams = fsdp.FullyShardedDataParallel._setup_streams

    def _setup_streams(self: Any) -> None:
        original_setup_streams(self)
        # Children share the root's dict object, so filling it in place reaches them too.
        if self._is_root and not self._streams:
            for name in ("fp32_to_fp16", "all_gather", "post_backward"):
                self._streams[name] = _cpu_stream()

    fsdp.FullyShardedDataParallel._setup_streams = _setup_streams

    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _cpu_stream()
    torch.cuda.synchronize = lambda device=None: None
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None

    original_record_stream = torch.Tensor.record_stream

    def _record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type != "cpu":
            original_record_stream(self, stream)

    torch.Tensor.record_stream = _record_stream

    original_pin_memory = torch.Tensor.pin_memory

    def _pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.device.type == "cpu" else original_pin_memory(self, *args, **kwargs)

    torch.Tensor.pin_memory = _pin_memory
    _INSTALLED = True


class _FreshCPUOutputsDist:
    """``torch.distributed`` as FSDP's module sees it, except that while ``active``, ``all_gather`` of CPU tensors
    writes into new output tensors (put into the caller's list), so the outputs of earlier gathers stay intact."""

    def __init__(self, dist: Any) -> None:
        self._dist = dist
        self.active = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.active and tensor.device.type == "cpu":
            tensor_list[:] = [torch.empty_like(t) for t in tensor_list]
        return self._dist.all_gather(tensor_list, tensor, *args, **kwargs)


class CPUFullyShardedStrategy(DDPFullyShardedStrategy):
    """``DDPFullyShardedStrategy`` that also runs on CPU processes (gloo), for tests and benchmarks."""

    def __init__(self, *args: Any, process_group_backend: Optional[str] = None, **kwargs: Any) -> None:
        install()
        if process_group_backend is None and not torch.cuda.is_available():
            process_group_backend = "gloo"
        super().__init__(*args, process_group_backend=process_group_backend, **kwargs)

    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            super().setup_distributed()
        else:
            # Skip only the parent's "GPU is not available" check.
            DDPStrategy.setup_distributed(self)
