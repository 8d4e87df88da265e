"""Checkpoint errors on every rank, the ``DDPFullyShardedStrategy`` side: a failure on one rank in the middle of
gathering the FSDP state dict does not desynchronise the ranks, and the ranks that keep the state dict check their
host memory before any of them gathers it.

The hooks are ``DDPFullyShardedStrategy``'s base class and the call sites in ``setup`` and
``lightning_module_state_dict``; ``CheckpointConnector.save_checkpoint`` raises the kept error on every rank.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
from typing import Any, Callable, Dict, List, Optional

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.ddp import DDPStrategy
from pytorch_lightning.utilities.checkpoint_errors import (
    _available_host_memory,
    _catching_state_dict_hooks,
    _CollectiveFailure,
    _exchange_failure_flags,
    _new_checkpoint_process_group,
)
from pytorch_lightning.utilities.distributed import distributed_available

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


class FSDPCheckpointErrorsMixin(DDPStrategy):
    """Methods of ``DDPFullyShardedStrategy`` that keep the ranks together when a checkpoint step fails on one."""

    def _setup_checkpoint_process_group(self) -> None:
        if getattr(self, "_checkpoint_process_group", None) is None:
            # every rank gets here: the group for the checkpoint failure-flag exchange, which waits for rank 0's writes
            # as long as ``PL_CHECKPOINT_TIMEOUT`` says, not as long as the default (NCCL) group's timeout
            self._checkpoint_process_group = _new_checkpoint_process_group()

    def _gather_state_dict_on_every_rank(self, gather: Callable[[], Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """``gather()``, FairScale's collective state-dict gather, or ``None`` where it failed on this rank.

        First the ranks that keep the state dict in host memory check that enough of it is available; if one does
        not, no rank gathers. If the local part of a unit's gather (FairScale's state-dict hook, which copies the
        unit's tensors) fails on a rank, that rank still takes part in the gathers of the remaining units. Either
        error is raised by ``Trainer.save_checkpoint`` on every rank before anything is written (see
        :meth:`_record_checkpoint_error`).
        """
        failure = _CollectiveFailure()
        modules = [m for m in self.lightning_module.modules() if isinstance(m, FullyShardedDataParallel)]
        memory_error = self._check_host_memory_for_state_dict(modules)
        failed_ranks = self._exchange_checkpoint_failure_flags(memory_error is not None)
        if failed_ranks:
            # no rank gathers: a rank that ran out of host memory in the middle of the gather would be killed
            if memory_error is not None:
                self._record_checkpoint_error(memory_error)
            elif not getattr(self, "_defer_checkpoint_errors", False):
                raise RuntimeError(
                    f"The state dict was not gathered: global rank {failed_ranks[0]} lacks the host memory for it."
                )
            return None
        with _catching_state_dict_hooks(modules, failure):
            state_dict = gather()
        if failure.failed:
            # every rank has been through every FSDP unit's gather: the error is raised once the other collectives
            # of the checkpoint have run too, see ``_record_checkpoint_error``
            self._record_checkpoint_error(failure.error)
            return None
        return state_dict

    def _check_host_memory_for_state_dict(self, modules: List["FullyShardedDataParallel"]) -> Optional[MemoryError]:
        """A ``MemoryError`` if this rank keeps the full state dict in host memory and has less of it
        available than the state dict needs (``MemAvailable`` of ``/proc/meminfo``; no check where that cannot be
        read), else ``None``."""
        if not modules or (self.state_dict_on_rank_0_only and self.global_rank != 0):
            return None
        if any(m.state_dict_device.type != "cpu" for m in modules):
            return None
        available = _available_host_memory()
        if available is None:
            return None
        tensors = list(self.lightning_module.parameters()) + list(self.lightning_module.buffers())
        needed = sum(
            (t._orig_size.numel() if hasattr(t, "_orig_size") else t.numel()) * t.element_size() for t in tensors
        )
        if needed <= available:
            return None
        return MemoryError(
            f"The full state dict needs about {needed / 2**20:.0f} MiB of host memory on global rank"
            f" {self.global_rank}, but only {available / 2**20:.0f} MiB is available."
        )

    def _exchange_checkpoint_failure_flags(self, failed: bool) -> List[int]:
        """The global ranks that report ``failed``. Collective when more than one process runs."""
        if not distributed_available() or self.world_size < 2:
            return [self.global_rank] if failed else []
        return _exchange_failure_flags(self, failed)

    def _record_checkpoint_error(self, error: BaseException) -> None:
        """Called at the end of a per-unit loop of :meth:`lightning_module_state_dict` or :meth:`optimizer_state`
        that failed on this rank: while ``Trainer.save_checkpoint`` gathers the state (``_defer_checkpoint_errors``),
        the first ``error`` is kept instead of raised, since the other ranks go on into the next collective of the
        checkpoint; the save takes it (``_pop_checkpoint_error``) once all of them have run and raises it on every
        rank, before anything is written. Called outside a save, this raises ``error``."""
        if not getattr(self, "_defer_checkpoint_errors", False):
            raise error
        if getattr(self, "_checkpoint_error", None) is None:
            self._checkpoint_error = error

    def _pop_checkpoint_error(self) -> Optional[BaseException]:
        error, self._checkpoint_error = getattr(self, "_checkpoint_error", None), None
        return error
