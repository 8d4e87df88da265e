"""Asynchronous FSDP checkpoints (``DDPFullyShardedStrategy(async_checkpoint=True)``): a streamed save blocks the
training thread only while every rank copies its own shards of the FSDP parameters and their optimizer state to host
memory and global rank 0 writes the checkpoint's structure; a thread on every rank then sends the shards, one unit at
a time, over a gloo group of its own to rank 0, which writes them into the same single file a streamed save writes,
and renames it into place once every rank succeeded.

The hooks are ``DDPFullyShardedStrategy``'s ``async_checkpoint`` argument; its base class hands the streamed save's
units, ``remove_checkpoint``, ``load_checkpoint``, ``setup_environment`` and ``teardown`` to these functions through the
strategy's checkpointer.
"""
# fork-feature: fork/fsdp-async-checkpoint.patch
import logging
import os
import sys
import threading
from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TYPE_CHECKING

import torch

from pytorch_lightning.strategies.fsdp_checkpoint_errors import _new_checkpoint_guard
from pytorch_lightning.strategies.fsdp_async_host_memory import _host_copies_fit, _HostCopies, _shards_to_copy
from pytorch_lightning.strategies.fsdp_introspection import _flat_shard, _piece_offsets
from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream
from pytorch_lightning.strategies.ddp import DDPStrategy
from pytorch_lightning.strategies.fsdp_streaming_save import _write_streamed_units
from pytorch_lightning.trainer.connectors.checkpoint_failures import _raise_on_every_rank_if_any_failed
from pytorch_lightning.trainer.states import TrainerFn, TrainerStatus
from pytorch_lightning.utilities.checkpoint_errors import (
    _checkpoint_process_group,
    _checkpoint_timeout,
    _exchange_flags,
    _failure_flag_buffers,
    _flagged_ranks,
    _new_checkpoint_process_group,
)
from pytorch_lightning.utilities.checkpoint_groups import _hold_process_group, _release_process_group
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _gather_to_first_rank
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from pytorch_lightning.utilities.streamed_checkpoint_file import _committed_if_complete, _StreamedCheckpointFile
from pytorch_lightning.utilities.types import _PATH

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

log = logging.getLogger(__name__)

#: How much lower than the training threads the writer threads run (``setpriority``, Linux): they only copy and write.
_WRITER_NICENESS = 10


class _UnitShard(NamedTuple):
    """This rank's copy of one flat parameter's shard, and on global rank 0 where its pieces go in the file.

    Args:
        shard: the copy, in host memory.
        numel: the flat parameter's number of elements, without FSDP's padding.
        pieces: on global rank 0, for each entry of the checkpoint the flat parameter holds: its placeholder, and the
            range of elements of the flat parameter it is.
    """

    shard: torch.Tensor
    numel: int
    pieces: List[Tuple[torch.Tensor, int, int]]


class _StateShard(NamedTuple):
    """This rank's copy of one optimizer-state tensor's shard, and on global rank 0 its placeholder."""

    shard: torch.Tensor
    numel: int
    placeholder: Optional[torch.Tensor]


class _BackgroundWork(NamedTuple):
    """What this rank's thread writes in one save in the background.

    Args:
        copies: this rank's host copies of its shards, handed back for the next save once this one is done.
        write: writes them, in the thread: given the save, it runs its collectives over the save's ``group`` (its
            ``guard`` agreeing before each), writes into its ``writer`` (global rank 0's file) or the file that
            names, and records a failure in the guard.
    """

    copies: List[torch.Tensor]
    write: Callable[["_BackgroundSave"], None]


def _wait_for_checkpoint(strategy: "DDPFullyShardedStrategy") -> None:
    """``DDPFullyShardedStrategy.wait_for_checkpoint`` (see its docstring)."""
    job = strategy._checkpoint_state.in_flight
    if job is None:
        return
    # the job stays in flight until every rank knows how it ended: a ``KeyboardInterrupt`` up to then leaves it
    # to ``_finish_checkpoint_in_flight_alone``
    job.join()
    group = _checkpoint_process_group(strategy)
    # a rank whose writer thread failed inside a collective leaves the others' threads waiting in it until the
    # background group's timeout: wait for them that long, and as long again for the exchange itself
    extend = group is not None and hasattr(group, "set_timeout")
    try:
        if extend:
            group.set_timeout(2 * _checkpoint_timeout())
        _raise_on_every_rank_if_any_failed(
            strategy.lightning_module.trainer,
            job.error,
            f"Saving the checkpoint to {str(job.filepath)!r} in the background",
        )
    except Exception:
        strategy._checkpoint_state.in_flight = None
        # every rank is here: a group whose collective failed (a timeout, a closed connection) is not used again,
        # the next save makes a new one
        _drop_background_process_group(strategy)
        raise
    finally:
        if extend:
            group.set_timeout(_checkpoint_timeout())
    strategy._checkpoint_state.in_flight = None
    strategy._checkpoint_state.host_copy_pool = job.copies
    _remove_replaced_checkpoints(strategy, job)
    job.run_after_commit()


def _remove_replaced_checkpoints(strategy: "DDPFullyShardedStrategy", job: "_BackgroundSave") -> None:
    """On global rank 0, remove the files ``remove_checkpoint`` was asked to remove while ``job`` was in flight,
    if it was committed: a file that cannot be removed is logged, not raised (it is an old checkpoint)."""
    if not job.committed:
        return
    for path in job.removals:
        if str(path) == str(job.filepath):
            continue
        try:
            DDPStrategy.remove_checkpoint(strategy, path)
        except OSError as ex:
            log.warning(f"Could not remove the replaced checkpoint {str(path)!r}: {ex}")


def _write_streamed_units_in_background(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, writer: Optional[_StreamedCheckpointFile]
) -> None:
    """The units of a streamed save, written in the background where the save may be (see
    :func:`_saves_in_background`) and the host copies fit; otherwise as a synchronous streamed save writes them."""
    if not _saves_in_background(strategy) or not _host_copies_fit(strategy, stream, writer):
        return _write_streamed_units(strategy, stream, writer)
    _start_background_save(strategy, writer, lambda pool: _copy_shards(strategy, stream, pool))


def _start_background_save(
    strategy: "DDPFullyShardedStrategy",
    writer: Optional[_StreamedCheckpointFile],
    copy: Callable[[_HostCopies], "_BackgroundWork"],
) -> None:
    """Start a save in the background on every rank or on none: every rank makes its host copies (``copy``, which
    returns what its thread then writes), the ranks agree, and each starts its thread; the save is then in flight.
    Collective. If a rank fails, every rank raises and the temporary file is removed."""
    guard = _new_checkpoint_guard(strategy)
    job: Optional[_BackgroundSave] = None
    try:
        with guard.catch():
            work = copy(_host_copy_pool(strategy))
        if guard.agree():
            # collective, and it raises on every rank if it failed on any: made only once every rank has its copies
            group = _background_process_group(strategy)
            with guard.catch():
                job = _new_background_save(strategy, writer, group, work)
        failed_ranks = guard.settle()
    except BaseException:
        _abandon_start(job, writer)
        raise
    if failed_ranks:
        # a step failed on some rank (host memory, "can't start new thread", ...): no rank's thread goes on, so
        # that none waits in a gather for a peer that never sends
        _abandon_start(job, writer)
        guard.raise_if_failed()
    assert job is not None
    # in flight before its thread runs a collective: whatever runs next on this thread sees it
    strategy._checkpoint_state.in_flight = job
    job.launch()


def _background_process_group(strategy: "DDPFullyShardedStrategy") -> Optional[Any]:
    """The background threads' own gloo group, made at their first save; ``None`` on one process. Collective
    when it is made: a process group must not be used by two threads at once, and the training thread keeps using
    the checkpoint and FSDP groups."""
    state = strategy._checkpoint_state
    if strategy.world_size > 1 and state.background_group is None:
        _hold_process_group(state, "background_group", _new_checkpoint_process_group(strategy))
    return state.background_group


def _drop_background_process_group(strategy: "DDPFullyShardedStrategy") -> None:
    """Destroy the background threads' group (every rank is here): after a failed collective it is not used
    again, and at the end of a stage it is not needed; the next background save makes a new one."""
    _release_process_group(strategy._checkpoint_state, "background_group")


def _new_background_save(
    strategy: "DDPFullyShardedStrategy",
    writer: Optional[_StreamedCheckpointFile],
    group: Optional[Any],
    work: _BackgroundWork,
) -> "_BackgroundSave":
    """A started :class:`_BackgroundSave` whose thread waits for :meth:`_BackgroundSave.launch`."""
    event = None
    if torch.cuda.is_available() and strategy.root_device.type == "cuda":
        # the copies to pinned host memory were queued on the current stream: the thread waits for them
        event = torch.cuda.Event()
        event.record()
    job = _BackgroundSave(strategy, strategy._checkpoint_state.session.filepath, writer, group, work, event)
    job.start()
    return job


def _saves_in_background(strategy: "DDPFullyShardedStrategy") -> bool:
    """Whether this streamed save is written in the background; the same on every rank."""
    if not strategy.async_checkpoint:
        return False
    state = strategy.lightning_module.trainer.state
    closed = strategy._checkpoint_state.background_closed
    if state.fn != TrainerFn.FITTING or state.status != TrainerStatus.RUNNING or closed:
        reason = (
            "it is saved outside `Trainer.fit` (or after its teardown began), which waits for a save in flight"
            " at its end"
        )
    elif strategy.world_size > 1 and _checkpoint_process_group(strategy) is None:
        reason = "`PL_CHECKPOINT_GLOO_GROUP=0`: the background thread needs a gloo group of its own"
    else:
        return True
    if reason != strategy._checkpoint_state.last_synchronous_reason:
        strategy._checkpoint_state.last_synchronous_reason = reason
        rank_zero_info(
            f"`DDPFullyShardedStrategy(async_checkpoint=True)`: the checkpoint is saved synchronously, because {reason}."
        )
    return False


def _host_copy_pool(strategy: "DDPFullyShardedStrategy") -> _HostCopies:
    """The host copies of the previous save in the background, to be reused where they fit: allocating (and, on the
    CPU, faulting in) a shard-sized buffer per tensor costs more than the copy itself."""
    pool = _HostCopies(strategy._checkpoint_state.host_copy_pool)
    strategy._checkpoint_state.host_copy_pool = []
    return pool


def _copy_shards(
    strategy: "DDPFullyShardedStrategy", stream: _CheckpointStream, pool: _HostCopies
) -> "_BackgroundWork":
    """This rank's copies (from ``pool``) of its shards of the FSDP parameters and, unless the save is weights-only,
    of their optimizer state, in the order the placeholders of ``stream`` were made, and the writing of them: sent to
    global rank 0 and written there into their places (see :func:`_gather_and_write`)."""
    by_source: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    for key, source in stream.model_sources.items():
        by_source.setdefault(source, []).append(stream.model[key])
    flats, tensors = _shards_to_copy(strategy, stream.weights_only)
    units = []
    for flat in flats:
        starts = _piece_offsets(flat)
        pieces = [
            (placeholder, starts[i], starts[i + 1])
            for i in range(len(flat._param_numels))
            for placeholder in by_source.get((id(flat), i), [])
        ]
        units.append(_UnitShard(pool.copy(_flat_shard(flat)), starts[-1], pieces))
    states = [
        _StateShard(pool.copy(value), numel, stream.optimizer_placeholders.get(key)) for key, value, numel in tensors
    ]
    copies = [unit.shard for unit in units] + [state.shard for state in states]
    return _BackgroundWork(copies, partial(_gather_and_write, units, states))


def _defer_removal_while_in_flight(strategy: "DDPFullyShardedStrategy", filepath: _PATH) -> bool:
    """Whether ``filepath`` is to be removed only once the save in flight is committed (then it is noted for it)."""
    job = strategy._checkpoint_state.in_flight
    if job is not None:
        # until the save in flight is committed, this file may be the only complete checkpoint on disk
        job.removals.append(filepath)
        return True
    return False


def _close_background_saves(strategy: "DDPFullyShardedStrategy", teardown: Callable[[], None]) -> None:
    """At the end of a stage: wait for the save in flight (or finish this rank's part of it alone after an error),
    then ``teardown``, the strategy's own."""
    job = strategy._checkpoint_state.in_flight
    trainer = getattr(strategy.lightning_module, "trainer", None)
    # from here on nothing waits for a save in the background: ``on_fit_end`` and ``teardown`` hooks save
    # synchronously
    strategy._checkpoint_state.background_closed = True
    try:
        if job is not None and trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
            # another error stops this rank, maybe alone: no collective, only this rank's part of the save
            _finish_checkpoint_in_flight_alone(strategy)
        elif job is not None:
            strategy.wait_for_checkpoint()
    finally:
        # the host copies kept for the next save in the background: there is none before the next fit
        strategy._checkpoint_state.host_copy_pool = []
        if job is None or not job.running():
            # an abandoned save's threads still use the group until their next agreement
            _drop_background_process_group(strategy)
        teardown()


def _in_flight_checkpoint_path(strategy: "DDPFullyShardedStrategy") -> Optional[_PATH]:
    """The path of the checkpoint being saved in the background, ``None`` if none is."""
    job = strategy._checkpoint_state.in_flight
    return None if job is None else job.filepath


def _run_once_committed(strategy: "DDPFullyShardedStrategy", callback: Callable[[], None]) -> None:
    """Run ``callback`` on this rank once the checkpoint being saved in the background is committed, in the
    training thread (never if it fails); at once if none is in flight."""
    job = strategy._checkpoint_state.in_flight
    if job is None:
        callback()
    else:
        job.after_commit.append(callback)


def _finish_checkpoint_in_flight_alone(strategy: "DDPFullyShardedStrategy") -> None:
    """Finish this rank's part of the save in flight without a collective, for a rank that stops with an error
    or on ``KeyboardInterrupt``, maybe alone, and say how it ended. The background threads of the other ranks
    go on with their own parts, so the save completes where every rank gets here; where a rank died it fails at
    the background group's timeout. A second ``KeyboardInterrupt`` while waiting abandons the save: every
    thread stops at its next agreement and the temporary file is removed."""
    job = strategy._checkpoint_state.in_flight
    if job is None:
        return
    path = str(job.filepath)
    # the other ranks' threads run once every rank agreed to start: so does this one, if it was not let go yet
    job.launch()
    log.warning(f"Waiting for the checkpoint being saved to {path!r} in the background to be written.")
    try:
        job.join()
    except KeyboardInterrupt:
        job.abandon()
        strategy._checkpoint_state.in_flight = None
        # its thread may still use the group until its next agreement: the next save makes a new one
        strategy._checkpoint_state.background_group = None
        log.error(
            f"The checkpoint being saved to {path!r} in the background was abandoned: unless it was complete"
            " already, the file at that path is the previous one, and the files it was to replace are kept."
        )
        return
    strategy._checkpoint_state.in_flight = None
    strategy._checkpoint_state.host_copy_pool = []
    _drop_background_process_group(strategy)
    _remove_replaced_checkpoints(strategy, job)
    if job.error is not None:
        _note_on_current_exception(
            f"The checkpoint being saved to {path!r} in the background failed too"
            f" ({type(job.error).__name__}: {job.error}); the file at that path is the previous one."
        )
    elif strategy.is_global_zero:
        log.warning(f"The checkpoint being saved to {path!r} in the background is committed.")
        job.run_after_commit()


class _BackgroundSave:
    """One checkpoint written in the background: on every rank a thread writes this rank's host copies (its
    :class:`_BackgroundWork`: sent to global rank 0, unit by unit, which writes them into ``writer``; or written by
    every rank into the file itself, see ``fsdp_parallel_save``) over the strategy's background group
    (``_checkpoint_state.background_group``); rank 0 commits ``writer`` if every rank succeeded.

    The ranks agree before each gather (see :class:`~pytorch_lightning.utilities.collective_guard._CollectiveGuard`,
    over the same group), so a failure on one rank stops every rank's thread there. The outcome is this rank's
    :attr:`error` (``None``, its own error, or ``_PeerFailed``) and, on rank 0, :attr:`committed`.
    """

    def __init__(
        self,
        strategy: "DDPFullyShardedStrategy",
        filepath: _PATH,
        writer: Optional[_StreamedCheckpointFile],
        group: Optional[Any],
        work: _BackgroundWork,
        event: Optional[Any],
    ) -> None:
        self.writer, self.event = writer, event
        self._write_copies: Optional[Callable[["_BackgroundSave"], None]] = work.write
        #: the host copies, handed back for the next save once this one is done
        self.copies = work.copies
        self.filepath = filepath
        self.rank, self.world_size = strategy.global_rank, strategy.world_size
        self.group = group
        exchange: Callable[[bool], List[int]]
        if self.world_size > 1:
            # allocated here, in the training thread, before anything can fail
            buffers = _failure_flag_buffers(strategy, self.group)

            # the group, not ``self``: a cycle through this job would keep the group, and its gloo threads, alive
            # until a garbage collection, maybe the finalizing interpreter's (see ``checkpoint_groups``)
            def exchange(failed: bool) -> List[int]:
                return _flagged_ranks(_exchange_flags(strategy, failed, buffers, group))

        else:

            def exchange(failed: bool) -> List[int]:
                return [self.rank] if failed else []

        self.guard = _CollectiveGuard(exchange)
        self.error: Optional[BaseException] = None
        self.committed = False
        #: the files ``remove_checkpoint`` was asked to remove while this save was in flight
        self.removals: List[_PATH] = []
        #: what to run in the training thread once the file is committed (loggers' ``after_save_checkpoint``)
        self.after_commit: List[Callable[[], None]] = []
        #: whether ``KeyboardInterrupt`` abandoned it
        self.abandoned = False
        self._launched = threading.Event()
        # set when the thread is done; waited on instead of ``Thread.join``, which a ``KeyboardInterrupt`` (CPython
        # < 3.13) leaves believing the thread stopped, so that the interpreter's exit no longer waits for the writer
        self._done = threading.Event()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="pl-async-checkpoint", daemon=False)

    def start(self) -> None:
        """Start the thread; it waits for :meth:`launch` (or :meth:`cancel`) before its first collective, so that
        the ranks can first agree that every rank's thread started."""
        self._thread.start()

    def launch(self) -> None:
        self._launched.set()

    def cancel(self) -> None:
        """Let a started thread end without any collective (the save did not start on every rank)."""
        self._cancelled = True
        self._launched.set()
        self.join()

    def abandon(self) -> None:
        """Stop the save at the thread's next agreement on every rank (the others' threads stop there too), and
        discard the file."""
        self.abandoned = True
        self.guard.record(RuntimeError("The checkpoint was abandoned (KeyboardInterrupt)."))
        self._launched.set()

    def join(self) -> None:
        if self._thread.ident is not None:
            self._done.wait()
            self._thread.join()

    def running(self) -> bool:
        return self._thread.ident is not None and not self._done.is_set()

    def run_after_commit(self) -> None:
        """Run :attr:`after_commit` if the file was committed; an error there is logged, not raised, so that it
        cannot take this rank out of the collectives of the save or load that waited for the commit."""
        callbacks, self.after_commit = self.after_commit, []
        if not (self.committed or self.writer is None):
            return
        for callback in callbacks:
            try:
                callback()
            except Exception as ex:
                log.error(f"A callback after the commit of {str(self.filepath)!r} failed: {type(ex).__name__}: {ex}")

    def _run(self) -> None:
        try:
            self._launched.wait()
            if not self._cancelled:
                self._write()
        finally:
            self._done.set()

    def _write(self) -> None:
        guard = self.guard
        try:
            # background work: the training threads of this host come first for the CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        try:
            with _committed_if_complete(self.writer):
                # inside the block: a device error surfacing here discards the temporary file too
                if self.event is not None:
                    self.event.synchronize()
                assert self._write_copies is not None
                self._write_copies(self)
                if not guard.settle() and self.writer is not None:
                    self.writer.complete = True
            self.committed = self.writer is not None and self.writer.committed
            if self.committed and self.abandoned:
                log.warning(f"The abandoned checkpoint {str(self.filepath)!r} was complete: it is committed.")
            self.error = guard.error_to_raise()
        except BaseException as ex:
            # e.g. the group's timeout: this rank's own error, raised by ``wait_for_checkpoint`` on every rank
            self.error = ex
        finally:
            # the placeholders and the plan are not needed any more; the copies are kept for the next save
            self._write_copies = None


def _gather_and_write(units: List[_UnitShard], states: List[_StateShard], job: _BackgroundSave) -> None:
    """Gather every rank's shards to global rank 0, one tensor at a time, and write each piece into its place in
    ``job.writer`` there; stops on every rank once a rank failed."""
    pieces = [(unit.shard, unit.numel, unit.pieces) for unit in units]
    # an optimizer-state tensor is flat, as FairScale consolidates it: one piece, the whole tensor
    pieces += [(state.shard, state.numel, [(state.placeholder, 0, state.numel)]) for state in states]
    for shard, numel, places in pieces:
        shards = _gather_to_first_rank(shard, job.guard, job.group, job.world_size)
        if shards is None:
            return
        if job.writer is not None:
            with job.guard.catch():
                for placeholder, start, end in places:
                    job.writer.write_shards(placeholder, shards, numel, start, end)


def _abandon_start(job: Optional[_BackgroundSave], writer: Optional[_StreamedCheckpointFile]) -> None:
    """Undo the start of a background save that did not start on every rank: end this rank's thread, if it started,
    and remove the temporary file."""
    if job is not None:
        job.cancel()
    if writer is not None:
        writer.discard()


def _note_on_current_exception(note: str) -> None:
    """Log ``note`` as an error and add it to the exception being handled, so that it is not lost behind it."""
    log.error(note)
    error = sys.exc_info()[1]
    if error is not None and hasattr(error, "add_note"):
        error.add_note(note)
