"""Checkpoint errors on every rank, the ``DDPFullyShardedStrategy`` side: a failure on one rank in the middle of
gathering the FSDP state dict does not desynchronise the ranks, and the ranks check that they have the host memory
for the checkpoint before any of them gathers it.

The hooks are ``DDPFullyShardedStrategy``'s checkpointer and the call sites in ``setup`` and
``lightning_module_state_dict``; ``CheckpointConnector.save_checkpoint`` raises the kept error on every rank.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TYPE_CHECKING

import torch

import pytorch_lightning as pl
from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.fsdp_guarded_gathers import (
    _agreeing_fairscale_collectives,
    _check_fairscale_interposable,
    _reset_interrupted_gathers,
)
from pytorch_lightning.strategies.fsdp_introspection import _flat_shard, _fsdp_instances
from pytorch_lightning.utilities.checkpoint_errors import (
    _all_gather_objects,
    _catching_state_dict_hooks,
    _checkpoint_arrival_timeout,
    _checkpoint_process_group,
    _checkpoint_timeout,
    _close_checkpoint_process_group,
    _ClosedCheckpointGroup,
    _exchange_flags,
    _failed_ranks,
    _failure_flag_buffers,
    _flagged_ranks,
    FINAL_EXCHANGE_FLAG,
    _new_checkpoint_process_group,
    _not_every_rank_began,
)
from pytorch_lightning.utilities.checkpoint_groups import _hold_process_group, _release_process_group
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _PeerFailed
from pytorch_lightning.utilities.distributed import distributed_available
from pytorch_lightning.utilities.host_memory import format_bytes, host_memory_bounds, MemoryBound, overcommitted_bound

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


def _setup_checkpoint_process_group(strategy: "DDPFullyShardedStrategy") -> None:
    _check_fairscale_interposable()  # at setup, not in the middle of the first save
    state = strategy._checkpoint_state
    group = state.checkpoint_group
    if group is not None:
        # a later stage (every rank gets here, and every rank has a group): replace the group where a failed
        # collective closed it on any rank, on every rank at once, since creating a group takes all of them
        if strategy.reduce_boolean_decision(not isinstance(group, _ClosedCheckpointGroup)):
            return
        if isinstance(group, _ClosedCheckpointGroup):
            state.checkpoint_group = None
        else:
            _release_process_group(state, "checkpoint_group")
    # the group for the checkpoint failure-flag exchange, which waits for rank 0's writes as long as
    # ``PL_CHECKPOINT_TIMEOUT`` says, not as long as the default (NCCL) group's timeout
    _hold_process_group(state, "checkpoint_group", _new_checkpoint_process_group(strategy))


def _agree_on_checkpoint_arrival(strategy: "DDPFullyShardedStrategy", action: str) -> None:
    """Return once every rank has begun this checkpoint save, before any other collective of it. Collective.

    The ranks all-gather one ``int32`` over the gloo checkpoint group, whose timeout is set to
    ``PL_CHECKPOINT_ARRIVAL_TIMEOUT`` meanwhile (on torch builds without ``ProcessGroup.set_timeout`` it stays
    ``PL_CHECKPOINT_TIMEOUT``). A rank cannot tell a rank that never calls the save from one that is late: both
    are named in the error. With ``PL_CHECKPOINT_GLOO_GROUP=0`` nothing is exchanged: the save's first
    collective waits as long as the default process group's timeout, as before.

    Args:
        action: what is being begun, naming the checkpoint path.

    Raises:
        CheckpointError: on the ranks that waited longer than that, and at once on a rank that arrives after they
            gave up (they closed the group); the group is closed on these ranks until the next stage replaces it.
    """
    if not distributed_available() or strategy.world_size < 2:
        return
    group = _checkpoint_process_group(strategy)
    if group is None:
        return
    bounded = hasattr(group, "set_timeout")
    waited = _checkpoint_arrival_timeout() if bounded else _checkpoint_timeout()
    try:
        if bounded:
            group.set_timeout(waited)
        _exchange_flags(strategy, 0, group=group)
    except Exception as ex:
        _close_checkpoint_process_group(strategy, f"the ranks did not all begin a checkpoint save ({action})")
        raise _not_every_rank_began(action, type(strategy).__name__, waited, ex) from ex
    if bounded:
        group.set_timeout(_checkpoint_timeout())


def _gather_full_state_dict(
    strategy: "DDPFullyShardedStrategy", gather: Callable[[], Dict[str, Any]]
) -> Optional[Dict[str, Any]]:
    """``gather()``, FairScale's collective state-dict gather (to global rank 0 with
    ``state_dict_on_rank_0_only=True``), or ``None`` where it failed on any rank.

    First the ranks check that they have the host memory for what they will hold (see
    :meth:`_check_host_memory_for_checkpoint`); if the ranks under one bound do not, no rank gathers anything.
    Before each of FairScale's collectives the ranks agree that all of them can take part (see
    :class:`~pytorch_lightning.utilities.collective_guard._CollectiveGuard`), so a failure on one rank, inside
    FairScale's gather of a unit (allocating its full parameters) or in FairScale's state-dict hook (which copies
    the unit's tensors), stops every rank before the next collective. The error is raised by
    ``Trainer.save_checkpoint`` on every rank before anything is written (see
    :meth:`~pytorch_lightning.strategies.fsdp_checkpoint_state._FSDPCheckpointState.record_error`).
    """
    modules = _fsdp_instances(strategy.lightning_module)
    memory_error, short_ranks = _check_host_memory_for_checkpoint(strategy, modules)
    session = strategy._checkpoint_state.gathering_session()
    if session is not None:
        # read by ``optimizer_state``: then no rank consolidates the optimizer state of this save either
        session.abandoned = bool(short_ranks)
    if short_ranks:
        # no rank gathers: a rank that ran out of host memory in the middle of the gather would be killed
        if memory_error is not None:
            strategy._checkpoint_state.record_error(memory_error)
        elif session is None:
            raise RuntimeError(
                f"The state dict was not gathered: global rank {short_ranks[0]} lacks the host memory for it."
            )
        return None
    guard = _new_checkpoint_guard(strategy)
    state_dict = None
    with _catching_state_dict_hooks(modules, guard), _agreeing_fairscale_collectives(guard, strategy._process_group):
        try:
            with guard.catch():
                state_dict = gather()
        except _PeerFailed:
            pass  # another rank failed: this one stopped with it
        finally:
            _reset_interrupted_gathers(modules)
    if strategy._checkpoint_state.abandon_if_failed(guard):
        return None
    return state_dict


def _check_host_memory_for_checkpoint(
    strategy: "DDPFullyShardedStrategy", modules: List["FullyShardedDataParallel"]
) -> Tuple[Optional[MemoryError], List[int]]:
    """Whether the ranks have the host memory for what they will hold while this checkpoint is gathered (see
    :meth:`_host_memory_needed`): a ``MemoryError`` on the ranks under a bound that they need more than,
    ``None`` on the others, and the global ranks under it (none if every rank has enough). Collective.
    """
    if not modules:
        return None, []
    short = _host_memory_shortfall(strategy, *_host_memory_needed(strategy, modules))
    if short is None:
        return None, []
    if strategy.global_rank not in short.ranks:
        return None, short.ranks
    return (
        MemoryError(
            f"Gathering the checkpoint needs about {format_bytes(short.needed)} of host memory ({short.held}), but"
            f" {short.bound.description} has only {format_bytes(short.bound.available)} available."
        ),
        short.ranks,
    )


def _host_memory_needed(
    strategy: "DDPFullyShardedStrategy", modules: List["FullyShardedDataParallel"]
) -> Tuple[int, str]:
    """The bytes of host memory this rank will hold while the checkpoint is gathered, and what for.

    - The full state dict, on the ranks that keep it (global rank 0, or every rank with
      ``state_dict_on_rank_0_only=False``), when it is gathered to the CPU (``state_dict_to_cpu=True``): every
      FSDP parameter at its full size, in full precision, and the buffers inside FSDP. The other tensors are in
      the state dict as they are, not copied.
    - While ``Trainer.save_checkpoint`` saves more than the weights, on global rank 0: the optimizer state
      consolidated there, every state tensor of an FSDP parameter at the parameter's full size, which is twice the
      model with Adam.
    """
    needed, held = 0, []
    if not strategy.state_dict_on_rank_0_only or strategy.global_rank == 0:
        if all(m.state_dict_device.type == "cpu" for m in modules):
            state_dict = _full_state_dict_bytes(modules)
            needed += state_dict
            held.append(f"the state dict, {format_bytes(state_dict)}")
    session = strategy._checkpoint_state.gathering_session()
    saving_optimizers = session is not None and not session.weights_only
    if saving_optimizers and strategy.global_rank == 0:
        optimizer_states = _consolidated_optimizer_state_bytes(strategy.optimizers, modules)
        needed += optimizer_states
        held.append(f"the consolidated optimizer state, {format_bytes(optimizer_states)}")
    return needed, " and ".join(held) or "nothing"


def _new_checkpoint_guard(strategy: "pl.strategies.DDPFullyShardedStrategy") -> _CollectiveGuard:
    """The guard of one per-unit loop of a checkpoint of ``strategy`` (see
    :class:`~pytorch_lightning.utilities.collective_guard._CollectiveGuard`). Its agreements exchange over tensors
    allocated here, before the loop's first step: a rank that ran out of memory still takes part in them."""
    if not distributed_available() or strategy.world_size < 2:
        return _CollectiveGuard(lambda failed: _failed_ranks(strategy, failed))
    buffers = _failure_flag_buffers(strategy)

    def exchange(failed: bool) -> List[int]:
        flags = _exchange_flags(strategy, failed, buffers)
        failed_ranks = _flagged_ranks(flags)
        if FINAL_EXCHANGE_FLAG in flags:
            # a rank that failed outside the loop is in the final exchange of the save (or load) already, and goes
            # on to broadcast its error: this rank joins it there, with these flags, after leaving the loop
            strategy._checkpoint_state.final_flags = failed_ranks
        return failed_ranks

    return _CollectiveGuard(exchange)


def _host_memory_shortfall(
    strategy: "pl.strategies.DDPFullyShardedStrategy", needed: int, what: str
) -> Optional["_HostMemoryShortfall"]:
    """The first bound on host memory under which the ranks need more than it has, or ``None``: the same on every
    rank. Collective when more than one process runs.

    The bounds are each host's ``MemAvailable`` and the limit of each memory cgroup (a container's, a Slurm job's)
    minus what it uses; the needs of the ranks that share one add up. See
    :func:`~pytorch_lightning.utilities.host_memory.host_memory_bounds`.

    Args:
        strategy: the strategy whose ranks report their needs.
        needed: the bytes of host memory this rank is about to allocate.
        what: what for, for the message.
    """
    report = (needed, host_memory_bounds() if needed else [])
    if distributed_available() and strategy.world_size > 1:
        reports = _all_gather_objects(strategy, (report, what))
    else:
        reports = [(report, what)]
    short = overcommitted_bound([r for r, _ in reports])
    if short is None:
        return None
    bound, ranks, total = short
    held = "; ".join(f"global rank {rank}: {reports[rank][1]}" for rank in ranks[:4])
    if len(ranks) > 4:
        held += f"; and {len(ranks) - 4} more ranks"
    return _HostMemoryShortfall(bound, ranks, total, held)


class _HostMemoryShortfall(NamedTuple):
    """A bound on host memory that the ranks under it need more than (see
    :func:`_host_memory_shortfall`).

    Args:
        bound: the bound, with what is available under it.
        ranks: the global ranks under it.
        needed: the bytes they need together.
        held: what the first of them need it for, for messages.
    """

    bound: MemoryBound
    ranks: List[int]
    needed: int
    held: str


def _full_state_dict_bytes(modules: List["FullyShardedDataParallel"]) -> int:
    """The bytes of the tensors that FairScale copies into the full state dict of the FSDP instances ``modules`` (all
    of them, nested ones too): their parameters, gathered in full precision, and the buffers inside them."""
    total = 0
    for module in modules:
        for param in module.params:
            size = getattr(param, "_orig_size", param.shape)
            total += size.numel() * _flat_shard(param).element_size()
    buffers = {id(b): (b, m.mixed_precision) for m in modules for b in m.buffers()}
    for buffer, mixed_precision in buffers.values():
        full_precision = mixed_precision and buffer.is_floating_point()
        total += buffer.numel() * max(buffer.element_size(), 4 if full_precision else 0)
    return total


def _consolidated_optimizer_state_bytes(optimizers: List[Any], modules: List["FullyShardedDataParallel"]) -> int:
    """The bytes of the optimizer state of the FSDP parameters of ``modules`` once consolidated: each state tensor
    shaped like a parameter's shard at the parameter's full size. The state of other parameters is saved as it is."""
    shards = {id(p): p for m in modules for p in m.params}
    total = 0
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            shard = shards.get(id(param))
            if shard is None:
                continue
            full = getattr(shard, "_orig_size", shard.shape).numel()
            for value in state.values():
                if torch.is_tensor(value) and value.dim() and value.numel() == shard.numel():
                    total += full * value.element_size()
    return total
