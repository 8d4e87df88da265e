"""FairScale's own collectives in a checkpoint's per-unit loops, guarded: while a loop of ``DDPFullyShardedStrategy``
gathers FSDP units (``summon_full_params``, FairScale's ``state_dict`` and optimizer-state gathers), every collective
FairScale calls is preceded by the ranks' agreement of
:class:`~pytorch_lightning.utilities.collective_guard._CollectiveGuard`.

FairScale allocates a unit's full-parameter buffer inside ``_rebuild_full_params``, right before its all-gather. A rank
that runs out of memory there raises out of FairScale without entering the all-gather, which the other ranks are
already in; an agreement before the strategy's own call would come too early. So the agreement sits at the collective
itself: FairScale's FSDP module calls ``torch.distributed`` through its module global ``dist``, which the loops
replace, for their duration and for the thread that runs them, with :class:`_AgreeingDistributed`.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
import threading
from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterable, List, Tuple

import torch

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _PeerFailed

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

#: The ``torch.distributed`` collectives that an agreement precedes when FairScale calls them.
_GUARDED_COLLECTIVES = frozenset(
    {
        "all_gather",
        "_all_gather_base",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor",
        "scatter",
        "barrier",
    }
)


class _AgreeingDistributed:
    """``torch.distributed`` as FairScale's FSDP module sees it, except that in the thread ``thread`` each collective
    of :data:`_GUARDED_COLLECTIVES` over ``group`` first calls ``guard.before_collective()``, which raises instead
    where a rank cannot take part. Collectives over other groups (a unit sharded over a group of its own, such as an
    expert's) pass as they are: the ranks of such groups need not call the same number of them."""

    def __init__(self, dist: Any, guard: _CollectiveGuard, thread: int, group: Any) -> None:
        self._dist, self._guard, self._thread, self._group = dist, guard, thread, group

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._dist, name)
        if name not in _GUARDED_COLLECTIVES:
            return attribute
        return self._agreeing(attribute)

    def _agreeing(self, collective: Callable) -> Callable:
        def agreed_collective(*args: Any, **kwargs: Any) -> Any:
            # a training thread that runs while another thread checkpoints (none does today) is left as it was
            if threading.get_ident() == self._thread and kwargs.get("group") is self._group:
                self._guard.before_collective()
            return collective(*args, **kwargs)

        return agreed_collective


@contextmanager
def _agreeing_fairscale_collectives(guard: _CollectiveGuard, group: Any) -> Generator[None, None, None]:
    """Within the block, every collective over ``group`` that FairScale's FSDP calls from this thread is preceded by
    an agreement of ``guard``.

    Args:
        guard: the guard of the loop the block runs.
        group: the FSDP process group of the units the loop gathers (FairScale passes it as ``group=``).
    """
    if not _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
        yield
        return
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module

    original = fsdp_module.dist
    fsdp_module.dist = _AgreeingDistributed(original, guard, threading.get_ident(), group)
    try:
        yield
    finally:
        fsdp_module.dist = original


def _gather_units_one_at_a_time(
    instances: List[Tuple[str, "FullyShardedDataParallel"]],
    guard: _CollectiveGuard,
    group: Any,
    work: Callable[[str, "FullyShardedDataParallel"], None],
    volatile: bool = False,
) -> None:
    """For each ``(prefix, instance)``: gather the instance's own full parameters (``summon_full_params(recurse=False)``,
    its collectives over ``group`` agreed first), run ``work(prefix, instance)`` and shard them again. An exception of
    the gather or of ``work`` is recorded in ``guard``; once any rank failed, every rank stops before the next gather.
    Collective.

    Args:
        instances: the FSDP instances, with their names in the LightningModule, in the order every rank gathers them.
        guard: the guard of the loop.
        group: the FSDP process group of the instances.
        work: this rank's local work on a gathered instance.
        volatile: as for ``summon_full_params``: ``True`` where ``work`` does not change the parameters.
    """
    with torch.no_grad(), _agreeing_fairscale_collectives(guard, group):
        for prefix, instance in instances:
            if guard.stopped:
                break
            try:
                with instance.summon_full_params(recurse=False, volatile=volatile):
                    with guard.catch():
                        work(prefix, instance)
            except _PeerFailed:
                pass
            except Exception as ex:
                guard.record(ex)
            finally:
                _reset_interrupted_gathers([instance])


def _reset_interrupted_gathers(instances: Iterable["FullyShardedDataParallel"]) -> None:
    """Leave the FSDP instances whose gather an exception interrupted as ``summon_full_params`` leaves them when it
    ends: full parameters freed, the parameters pointing at this rank's shards, ready for the next forward or gather.

    An exception raised inside FairScale's ``_rebuild_full_params`` (running out of memory while allocating the
    full-parameter buffer, or another rank's failure, see :class:`_AgreeingDistributed`) comes before the
    ``try``/``finally`` of ``summon_full_params``, which would have done this.
    """
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

    for instance in instances:
        if instance.training_state != TrainingState.SUMMON_FULL_PARAMS:
            continue
        instance._free_full_params()
        if instance.mixed_precision or instance.move_params_to_cpu:
            instance._free_fp16_param_shard()
        instance._use_fp32_param_shard()
        instance.training_state = TrainingState.IDLE
