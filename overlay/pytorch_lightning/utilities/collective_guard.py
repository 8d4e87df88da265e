"""No rank skips a collective that another rank is in: before each collective of a checkpoint's per-unit loops, the
ranks tell each other whether they can take part, over the strategy's gloo checkpoint group. A rank that failed
(running out of memory while it allocates a unit's buffers, say) says so instead of entering the collective; then
no rank enters it, and every rank leaves the loop at the same point.

The waits are on the checkpoint group, whose timeout is ``PL_CHECKPOINT_TIMEOUT``, so the ranks that wait while
global rank 0 writes a unit of a streamed checkpoint wait there, not in the next gather on the default group, which
NCCL's watchdog would end after its own timeout (ten minutes in most builds).

Used by the per-unit loops of ``DDPFullyShardedStrategy`` (gathering the state dict and the optimizer state, the
streamed save, the per-unit load), through
:func:`~pytorch_lightning.strategies.fsdp_guarded_gathers._agreeing_fairscale_collectives` for FairScale's own
collectives.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
from contextlib import contextmanager
from typing import Any, Callable, Generator, List, Optional

import torch

#: Whether the ranks agree before each collective. Only the checkpoint benchmark turns it off, to measure what the
#: agreement costs; without it a failure on one rank leaves the others waiting in the collective it skipped.
AGREE_BEFORE_COLLECTIVES = True


class _PeerFailed(RuntimeError):
    """Raised on a rank that stopped taking part in a checkpoint's collectives because other ranks failed.
    ``Trainer.save_checkpoint`` and the restore turn it into the failing rank's ``CheckpointError``; it is raised as it
    is only by a direct call of a strategy method outside them.

    Args:
        failed_ranks: the global ranks that failed.
    """

    def __init__(self, failed_ranks: List[int]) -> None:
        super().__init__(
            f"Global rank {failed_ranks[0] if failed_ranks else '?'} failed in the middle of a checkpoint's collective"
            " steps, so this rank stopped too, before the next collective."
        )
        self.failed_ranks = list(failed_ranks)


class _PeerLost(RuntimeError):
    """Raised on a rank whose exchange with the other ranks itself failed: gloo saw a closed connection (a rank
    died) or timed out (a rank slower than ``PL_CHECKPOINT_TIMEOUT``), once the rank named the ranks that did not
    arrive (see :mod:`~pytorch_lightning.strategies.fsdp_lost_writers`). Its group is closed, so
    ``Trainer.save_checkpoint`` raises it as a ``CheckpointError`` on each rank without another exchange.

    Args:
        lost_ranks: the global ranks that did not arrive (empty where they could not be told).
        cause: what happened to them, for the message.
    """

    def __init__(self, lost_ranks: List[int], cause: str) -> None:
        super().__init__(cause)
        self.lost_ranks = list(lost_ranks)


class _CollectiveGuard:
    """Records this rank's first error in a sequence of collective steps (:meth:`catch`, :meth:`record`), and lets
    the ranks agree before each collective whether all of them can take part (:meth:`agree`).

    A rank whose local work failed does no collective any more other than the agreement, where it reports the
    failure; every agreement is the same small exchange over the same group, so it meets the other ranks in the one
    they are in, whichever step that is. After an agreement that saw a failure, no rank calls another collective of
    the sequence; :meth:`settle` at its end tells every rank whether any step failed anywhere.

    Args:
        exchange: the exchange of failure flags, a collective that returns the global ranks that report ``True``
            (:func:`~pytorch_lightning.utilities.checkpoint_errors._exchange_flags`).
    """

    def __init__(self, exchange: Callable[[bool], List[int]]) -> None:
        self._exchange = exchange
        #: this rank's first error
        self.error: Optional[Exception] = None
        #: the global ranks that failed, once an agreement saw a failure
        self.failed_ranks: List[int] = []
        #: called before each exchange, e.g. to mark this rank's arrival where the others can see it without one
        self.before_exchange: Optional[Callable[[], None]] = None
        self._settled = False

    @property
    def failed(self) -> bool:
        """Whether this rank failed."""
        return self.error is not None

    @property
    def stopped(self) -> bool:
        """Whether this rank takes no further part in the sequence's work: it failed, or an agreement saw a failure."""
        return self.failed or bool(self.failed_ranks)

    def record(self, error: Exception) -> None:
        """Record ``error`` as this rank's failure (the first one only), to be reported at the next agreement."""
        if self.error is None:
            self.error = error

    @contextmanager
    def catch(self) -> Generator[None, None, None]:
        """Record an exception raised inside the block instead of propagating it; a :class:`_PeerFailed` (another
        rank failed) propagates, it is not this rank's failure."""
        try:
            yield
        except _PeerFailed:
            raise
        except Exception as ex:
            self.record(ex)

    def agree(self) -> bool:
        """Whether every rank can take part in the next collective. Collective, until an agreement saw a failure;
        from then on it returns ``False`` without communicating."""
        if self.failed_ranks:
            return False
        if not AGREE_BEFORE_COLLECTIVES:
            return not self.failed
        self.failed_ranks = self._exchanged()
        return not self.failed_ranks

    def before_collective(self) -> None:
        """Call right before a collective, with nothing that can fail in between.

        Raises:
            _PeerFailed: on every rank, if any rank cannot take part; the collective must then be skipped.
        """
        if not self.agree():
            raise _PeerFailed(self.failed_ranks)

    def settle(self) -> List[int]:
        """The global ranks on which the sequence failed, on every rank: one last agreement, unless one already saw
        a failure or the sequence is settled already (a later call returns the same ranks). Collective then."""
        if not self.failed_ranks and not self._settled:
            self.failed_ranks = self._exchanged()
        self._settled = True
        return self.failed_ranks

    def _exchanged(self) -> List[int]:
        if self.before_exchange is not None:
            self.before_exchange()
        return self._exchange(self.failed)

    def error_to_raise(self) -> Optional[Exception]:
        """This rank's own error, or a :class:`_PeerFailed` where only other ranks failed, or ``None``."""
        if self.error is not None:
            return self.error
        return _PeerFailed(self.failed_ranks) if self.failed_ranks else None

    def raise_if_failed(self) -> None:
        error = self.error_to_raise()
        self.error = None
        if error is not None:
            raise error


def _gather_to_first_rank(
    tensor: Optional[torch.Tensor], guard: _CollectiveGuard, group: Optional[Any], world_size: int
) -> Optional[List[torch.Tensor]]:
    """Every rank's ``tensor`` (all of one shape) on the first rank of ``group`` (the default group where ``None``),
    ``[]`` on the others, or ``None`` once a rank failed. Collective: the ranks agree before the gather (see ``guard``).

    The first rank allocates the buffers it receives into before the agreement, so that running out of memory there
    stops every rank before the gather rather than in it; a rank that failed already allocates nothing more.
    """
    root = _group_root(group) if world_size > 1 else 0
    received = None
    if world_size > 1 and not guard.stopped and torch.distributed.get_rank() == root:
        with guard.catch():
            received = [torch.empty_like(tensor) for _ in range(world_size)]
    if not guard.agree():
        return None
    if world_size == 1:
        return [tensor]
    torch.distributed.gather(tensor, received, dst=root, group=group)
    return received if received is not None else []


def _group_root(group: Optional[Any]) -> int:
    """The global rank of the first rank of ``group`` (the default group where ``None``)."""
    if group is None:
        return 0
    get_global_rank = getattr(torch.distributed, "get_global_rank", None)  # public since torch 2.0
    if get_global_rank is None:
        get_global_rank = torch.distributed.distributed_c10d._get_global_rank
    return get_global_rank(group, 0)
