"""Checkpoint errors on every rank, the ``CheckpointConnector`` side: a failed save or load raises the same
:class:`~pytorch_lightning.utilities.exceptions.CheckpointError` on every rank instead of leaving the ranks that did
not fail waiting in the next collective.

The hooks are ``CheckpointConnector``'s ``_failures`` part and the call sites in ``resume_start``, ``restore_model``,
``restore_optimizers`` and ``save_checkpoint``; ``_load_and_validate_checkpoint`` and ``resume_end`` call its check of
the bytes a restore reads (fork/verified-checkpoints).
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
from contextlib import nullcontext
from typing import Any, Dict, List, NoReturn, Optional, Tuple

import pytorch_lightning as pl
from pytorch_lightning.utilities.checkpoint_errors import (
    _broadcast_failure,
    _checkpoint_error_type,
    _checkpoint_error_type_named,
    _checkpoint_timeout,
    _close_checkpoint_process_group,
    _describe_error,
    _error_type_name,
    _exchange_flags,
    _flagged_ranks,
    CHECKPOINT_TIMEOUT_ENV,
    FINAL_EXCHANGE_FLAG,
)
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.checkpoint_verification import _finish_restore_check, _open_read_check
from pytorch_lightning.utilities.collective_guard import _PeerFailed, _PeerLost
from pytorch_lightning.utilities.distributed import distributed_available
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException
from pytorch_lightning.utilities.types import _PATH


class _CheckpointFailures:
    """The part of ``CheckpointConnector`` that turns a failure on one rank into a ``CheckpointError`` on all: its
    save, its agreement that every rank saves, and the context of each step of its restore.

    Args:
        connector: the connector whose trainer's ranks save and load.
    """

    def __init__(self, connector: "pl.trainer.connectors.checkpoint_connector.CheckpointConnector") -> None:
        self._connector = connector

    def raising_on_every_rank(self, action: str, hint: Optional[str] = None) -> "_RaisingOnEveryRank":
        """A context manager: run the block; if it raised on any rank, raise the same ``CheckpointError`` on every
        rank (see :func:`_raise_on_every_rank_if_any_failed`). Collective when more than one process runs.

        Args:
            action: what the block does, naming the checkpoint path.
            hint: an optional sentence appended to the message.
        """
        return _RaisingOnEveryRank(self._connector.trainer, action, hint)

    def open_read_check(self, checkpoint_path: _PATH, checkpoint: Dict[str, Any]) -> None:
        """Right after ``checkpoint`` was loaded from ``checkpoint_path``: open the check of the bytes the restore
        reads against their CRC-32s (see :mod:`~pytorch_lightning.utilities.checkpoint_verification`)."""
        _open_read_check(checkpoint_path, checkpoint)

    def raise_if_reads_were_corrupt(self) -> None:
        """In ``resume_end``, once everything was restored and before any step runs: raise the same
        ``CheckpointError`` on every rank if a record the restore read does not match its CRC-32. Collective when
        more than one process runs."""
        path = self._connector.resume_checkpoint_path
        with self.raising_on_every_rank(f"Checking the CRC-32s of the checkpoint at {_redacted(path)!r}"):
            _finish_restore_check(self._connector.trainer)

    def agree_that_every_rank_saves(self, filepath: _PATH) -> None:
        """Called first by ``Trainer.save_checkpoint``: with a strategy whose save is a collective that the ranks begin
        by agreeing that all of them are in it (FSDP's, see ``_agree_on_checkpoint_arrival``), return once they
        are, or raise ``CheckpointError`` after ``PL_CHECKPOINT_ARRIVAL_TIMEOUT``. Collective for those strategies."""
        strategy = self._connector.trainer.strategy
        if isinstance(strategy, pl.strategies.DDPFullyShardedStrategy):
            strategy._checkpointer.agree_on_arrival(f"Saving the checkpoint to {_redacted(filepath)!r}")

    def save_checkpoint_on_every_rank(
        self, filepath: _PATH, weights_only: bool = False, storage_options: Optional[Any] = None
    ) -> None:
        """``CheckpointConnector.save_checkpoint``: dump the checkpoint and let the strategy save it; a failure on
        any rank raises on every rank when the strategy gathers the state on all of them (FSDP, DeepSpeed), else on
        the failing rank alone."""
        strategy = self._connector.trainer.strategy
        action = f"Saving the checkpoint to {_redacted(filepath)!r}"
        collective = isinstance(strategy, (pl.strategies.DDPFullyShardedStrategy, pl.strategies.DeepSpeedStrategy))
        checkpoint, error = self._dump_checkpoint(filepath, weights_only, storage_options)
        if collective:
            # Collective: the ranks agree that the state was gathered everywhere before anything is written, so that
            # a failure on one rank never replaces the previous checkpoint with an incomplete one.
            self.raise_on_every_rank_if_any_failed(error, action)
        elif error is not None:
            # other strategies let users call ``trainer.save_checkpoint`` on rank 0 alone, where a collective would hang
            self.raise_on_every_rank_if_any_failed(error, action, collective=False)
        error = None
        try:
            strategy.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        except Exception as ex:
            error = ex
        # With FSDP and DeepSpeed every rank is here, since they gathered the state together. Collective: the ranks
        # that did not write learn whether the write succeeded, so that a failure stops every rank at once instead of
        # leaving them waiting in the next collective until the process group times out.
        self.raise_on_every_rank_if_any_failed(error, action, collective=collective)

    def _dump_checkpoint(
        self, filepath: _PATH, weights_only: bool, storage_options: Optional[Any]
    ) -> Tuple[Optional[Dict[str, Any]], Optional[BaseException]]:
        """``dump_checkpoint``, and this rank's error if it failed. Under ``DDPFullyShardedStrategy`` a rank that fails
        inside a per-unit loop of gathering the state keeps taking part in the loop's collectives and in those that
        follow (the model's state dict, then one consolidation per optimizer): the save's session keeps the error
        until the dump is done."""
        strategy = self._connector.trainer.strategy
        session = None
        if isinstance(strategy, pl.strategies.DDPFullyShardedStrategy):
            # decided before the state is gathered: whether the strategy writes it while gathering it
            session = strategy._checkpointer.begin_save(filepath, weights_only, storage_options)
        checkpoint, error = None, None
        try:
            with session.gathering_state() if session is not None else nullcontext():
                checkpoint = self._connector.dump_checkpoint(weights_only)
        except Exception as ex:
            error = ex
        pending = session.pop_error() if session is not None else None
        return checkpoint, pending if pending is not None else error

    def raise_on_every_rank_if_any_failed(
        self, error: Optional[BaseException], action: str, hint: Optional[str] = None, collective: bool = True
    ) -> None:
        """See :func:`_raise_on_every_rank_if_any_failed`."""
        _raise_on_every_rank_if_any_failed(self._connector.trainer, error, action, hint, collective)


def _check_loaded_checkpoint(loaded_checkpoint: Any) -> None:
    if not isinstance(loaded_checkpoint, dict):
        raise TypeError(f"Expected the checkpoint to be a `dict`, but it holds a `{type(loaded_checkpoint).__name__}`.")


def _raise_on_every_rank_if_any_failed(
    trainer: "pl.Trainer",
    error: Optional[BaseException],
    action: str,
    hint: Optional[str] = None,
    collective: bool = True,
) -> None:
    """Raise the same :class:`~pytorch_lightning.utilities.exceptions.CheckpointError` on every rank if ``error`` is
    set on any rank.

    This is a collective call when more than one process runs: every rank must call it, whether it failed or not. It
    costs one small ``all_gather``, plus one ``broadcast`` of the error message and of the name of the error's type
    when a rank failed, over the strategy's checkpoint process group if it has one (see :func:`_exchange_flags`).

    Args:
        trainer: the trainer whose ranks saved or loaded.
        error: the exception this rank raised, or ``None`` if it succeeded.
        action: what failed, naming the checkpoint path, e.g. ``"Saving the checkpoint to 'last.ckpt'"``.
        hint: an optional sentence appended to the message.
        collective: ``False`` raises on this rank only, without communicating.

    The error raised is also an instance of the original error's type (the failing rank's own, the first failing
    rank's on the others), so that ``except FileNotFoundError:`` and the like catch it as they did before. A
    ``MisconfigurationException`` is a user error, not a failed write: the rank that raised it re-raises it
    unchanged, after the other ranks have been told.
    """
    suffix = f" {hint}" if hint else ""
    if isinstance(error, _PeerLost):
        # the exchange itself failed and the group is closed: the error already names the lost ranks
        raise _checkpoint_error_type(RuntimeError)(f"{action} failed{_lost_ranks(error)}.{suffix}") from error
    if not collective or not distributed_available() or trainer.world_size < 2:
        if isinstance(error, MisconfigurationException):
            raise error
        if error is not None:
            message = f"{action} failed: {_describe_error(error)}.{suffix}"
            raise _checkpoint_error_type(type(error))(message) from error
        return
    # a rank that stopped because another one failed (``_PeerFailed``) reports no failure of its own: the message
    # names the rank that failed and its cause
    stopped = isinstance(error, _PeerFailed)
    try:
        failed_ranks = _final_failed_ranks(trainer.strategy, error is not None and not stopped)
    except Exception as exchange_error:
        _raise_after_failed_exchange(trainer.strategy, error, exchange_error, action, suffix)
    if not failed_ranks:
        if stopped:
            # cannot happen while the ranks agree; raised rather than lost
            raise _checkpoint_error_type(RuntimeError)(f"{action} failed: {error}{suffix}") from error
        return
    if isinstance(error, MisconfigurationException):
        raise error
    cause = None if stopped else error
    try:
        failure = _error_of_first_failed_rank(trainer, cause, failed_ranks, action, suffix)
    except Exception as exchange_error:
        _raise_after_failed_exchange(trainer.strategy, error, exchange_error, action, suffix, failed_ranks)
    raise failure from cause


def _raise_after_failed_exchange(
    strategy: "pl.strategies.Strategy",
    error: Optional[BaseException],
    exchange_error: Exception,
    action: str,
    suffix: str,
    failed_ranks: Optional[List[int]] = None,
) -> NoReturn:
    """Raise where the ranks' final exchange of who failed (or of the first failed rank's error) itself failed: a
    rank was lost (gloo saw its closed connection) or is slower than the exchange's timeout. This rank's own error,
    if any, is kept as the cause, in the message and in the type; the checkpoint group is closed, so that the ranks
    still in it fail at once instead of after its timeout. Called in an ``except`` block."""
    if isinstance(exchange_error, CheckpointError):
        raise exchange_error  # the checkpoint group was closed by an earlier failure: its error says so
    # only the fork's gloo checkpoint group has ``PL_CHECKPOINT_TIMEOUT``; without one the default group was used
    own_group = (
        isinstance(strategy, pl.strategies.DDPFullyShardedStrategy)
        and strategy._checkpoint_state.checkpoint_group is not None
    )
    bound = (
        f"`{CHECKPOINT_TIMEOUT_ENV}` ({_checkpoint_timeout().total_seconds():g} s)"
        if own_group
        else "the process group's timeout"
    )
    told = "which of them failed" if failed_ranks is None else f"the error of global rank {failed_ranks[0]}"
    lost = (
        f"the ranks could not tell each other {told}: their exchange failed with {_describe_error(exchange_error)}"
        f" (a rank was lost, or is slower than {bound})"
    )
    if own_group:
        _close_checkpoint_process_group(strategy, f"the ranks' final exchange of a checkpoint failed; {lost}")
    if isinstance(error, MisconfigurationException):
        raise error
    if error is None:
        message, error_type = f"{action} failed: this rank's part succeeded, but {lost}.{suffix}", RuntimeError
    elif isinstance(error, _PeerFailed):
        ranks = error.failed_ranks
        message = f"{action} failed: global rank {ranks[0] if ranks else '?'} failed first; then {lost}.{suffix}"
        error_type = RuntimeError
    else:
        message, error_type = f"{action} failed: {_describe_error(error)}; then {lost}.{suffix}", type(error)
    raise _checkpoint_error_type(error_type)(message) from (error if error is not None else exchange_error)


def _lost_ranks(lost: _PeerLost) -> str:
    ranks = lost.lost_ranks
    if not ranks:
        return f": {lost}"
    return f" on global rank{'s' if len(ranks) > 1 else ''} {ranks[0] if len(ranks) == 1 else ranks}: {lost}"


def _final_failed_ranks(strategy: "pl.strategies.Strategy", failed: bool) -> List[int]:
    """The global ranks that failed, from the final failure-flag exchange of a save or load. Collective."""
    if isinstance(strategy, pl.strategies.DDPFullyShardedStrategy):
        # a loop's agreement may have met this exchange of a rank that failed outside the loop: then this rank has
        # its flags already, and that rank is on its way to the broadcast of its error
        flags = strategy._checkpointer.state.take_final_flags()
        if flags is not None:
            return flags
    return _flagged_ranks(_exchange_flags(strategy, FINAL_EXCHANGE_FLAG if failed else 0))


def _error_of_first_failed_rank(
    trainer: "pl.Trainer", error: Optional[BaseException], failed_ranks: List[int], action: str, suffix: str
) -> CheckpointError:
    """The error to raise on this rank: the first failed rank broadcasts its error's description and type, and every
    rank builds a ``CheckpointError`` of that type (its own error's type on a rank that failed). Collective."""
    src = failed_ranks[0]
    failure = (_describe_error(error), *_error_type_name(error)) if trainer.global_rank == src else None
    cause, module, qualname = _broadcast_failure(trainer.strategy, failure, src)
    message = f"{action} failed on global rank {src}: {cause}."
    if len(failed_ranks) > 1:
        message += f" It also failed on global ranks {failed_ranks[1:]}."
    if error is None:
        message += " This rank stops too, so that no rank waits for the others."
        error_type = _checkpoint_error_type_named(module, qualname)
    else:
        error_type = _checkpoint_error_type(type(error))
    return error_type(message + suffix)


class _RaisingOnEveryRank:
    """See :meth:`_CheckpointFailures.raising_on_every_rank`. A class rather than a generator: a
    ``CheckpointError[StopIteration]`` raised from a generator would turn into a ``RuntimeError``."""

    def __init__(self, trainer: "pl.Trainer", action: str, hint: Optional[str]) -> None:
        self.trainer, self.action, self.hint = trainer, action, hint

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, error: Optional[BaseException], traceback: Any) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # ``KeyboardInterrupt`` and the like stop this rank as they are
        _raise_on_every_rank_if_any_failed(self.trainer, error, self.action, hint=self.hint)
        return False
