"""The state of ``DDPFullyShardedStrategy``'s checkpoints, as explicit values: :class:`_FSDPCheckpointState`, made
with the strategy's checkpointer (``_FSDPCheckpointer``, which owns it), holds what outlives one save (the fork's
process groups, the save in flight, what was last logged); :class:`_SaveSession`, made by each
``Trainer.save_checkpoint``, holds what one save learns on its way.

The hook is ``DDPFullyShardedStrategy.__init__``, which makes the checkpointer; ``CheckpointConnector.save_checkpoint``
marks when the session gathers the state.
"""
# fork-feature: fork/fsdp-streaming-save.patch
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, TYPE_CHECKING, Union

import torch

from pytorch_lightning.utilities.types import _PATH

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fsdp_async_checkpoint import _BackgroundSave
    from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream
    from pytorch_lightning.utilities.collective_guard import _CollectiveGuard


class _NotDecided:
    """The stream decision before the first save: neither a reason (``str``) nor streamed (``None``)."""

    def __repr__(self) -> str:
        return "<no save yet>"


NOT_DECIDED = _NotDecided()


@dataclass
class _SaveSession:
    """One ``Trainer.save_checkpoint`` of a ``DDPFullyShardedStrategy``, from its stream decision to its write.

    Args:
        filepath: where the checkpoint is saved.
        weights_only: whether it holds the weights alone (no optimizer state).
        stream: the placeholders of a streamed save, until the save writes them (``None`` where it is not streamed).
        gathering: whether ``dump_checkpoint`` gathers the state now; only then do the strategy's state methods
            return placeholders and keep a failure for the save to raise on every rank.
        abandoned: whether the save already failed on every rank, so that the rest of it gathers nothing.
        error: the first failure of this rank while gathering, raised on every rank once all gathered.
    """

    filepath: Optional[_PATH] = None
    weights_only: bool = False
    stream: Optional["_CheckpointStream"] = None
    gathering: bool = False
    abandoned: bool = False
    error: Optional[BaseException] = None

    def record(self, error: BaseException) -> None:
        """Keep ``error`` if it is this save's first."""
        if self.error is None:
            self.error = error

    def pop_error(self) -> Optional[BaseException]:
        error, self.error = self.error, None
        return error

    @contextmanager
    def gathering_state(self) -> Iterator["_SaveSession"]:
        """Within the block, the state is gathered for this save (see :attr:`gathering`)."""
        self.gathering = True
        try:
            yield self
        finally:
            self.gathering = False


@dataclass
class _FSDPCheckpointState:
    """What a ``DDPFullyShardedStrategy``'s checkpoints keep between saves.

    Args:
        checkpoint_group: the gloo group of the failure-flag exchanges, made in ``setup`` (``None`` without one; a
            ``_ClosedCheckpointGroup`` after a collective over it failed).
        background_group: the gloo group of the background saves' threads, made at the first of them.
        session: the save under way, from its stream decision on.
        final_flags: the failure flags a loop's agreement received from the final exchange of a rank that failed
            outside the loop; this rank joins that exchange with them (see ``_raise_on_every_rank_if_any_failed``).
        last_stream_reason: why the last save was not streamed (``None``: streamed), logged when it changes.
        last_synchronous_reason: why the last save was not written in the background, logged when it changes.
        in_flight: the save being written in the background.
        host_copy_pool: the host copies of the last background save, reused by the next.
        background_closed: whether the stage's teardown began, after which no save goes to the background.
    """

    checkpoint_group: Optional[Any] = None
    background_group: Optional[Any] = None
    session: Optional[_SaveSession] = None
    final_flags: Optional[List[int]] = None
    last_stream_reason: Union[str, None, _NotDecided] = NOT_DECIDED
    last_synchronous_reason: Optional[str] = None
    in_flight: Optional["_BackgroundSave"] = None
    host_copy_pool: List[torch.Tensor] = field(default_factory=list)
    background_closed: bool = False

    def gathering_session(self) -> Optional[_SaveSession]:
        """The save whose state is being gathered now, ``None`` outside ``dump_checkpoint``."""
        session = self.session
        return session if session is not None and session.gathering else None

    def active_stream(self) -> Optional["_CheckpointStream"]:
        """The placeholders of the streamed save whose state is being gathered now; ``None`` outside one, where the
        strategy's state methods return the state itself."""
        session = self.gathering_session()
        return None if session is None else session.stream

    def record_error(self, error: BaseException) -> None:
        """Called at the end of a per-unit loop of gathering the state that failed on this rank (a ``_PeerFailed``
        on the ranks that stopped because another one failed): while ``Trainer.save_checkpoint`` gathers the state,
        the first ``error`` is kept instead of raised, since the ranks go on into the next collectives of the
        checkpoint (the failure-flag exchanges); the save takes it once all of them have run and raises it on every
        rank, before anything is written. Called outside a save, this raises ``error``."""
        session = self.gathering_session()
        if session is None:
            raise error
        session.record(error)

    def abandon_if_failed(self, guard: "_CollectiveGuard") -> bool:
        """Settle ``guard`` (collective); if its loop failed on any rank, record the error for
        ``Trainer.save_checkpoint`` to raise on every rank (see :meth:`record_error`), let the rest of this save
        gather nothing more, and return ``True``."""
        if not guard.settle():
            return False
        session = self.gathering_session()
        if session is not None:
            session.abandoned = True
        self.record_error(guard.error_to_raise())
        return True

    def take_final_flags(self) -> Optional[List[int]]:
        flags, self.final_flags = self.final_flags, None
        return flags
