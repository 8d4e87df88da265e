"""Slurm's ``SIGUSR1`` with ``SLURMEnvironment(auto_requeue=True)``: the HPC checkpoint is saved at a training batch
boundary on every rank, and the job is requeued only once the checkpoint is committed.

Slurm sends ``SIGUSR1`` (``sbatch --signal=USR1@<seconds>``) to every task of the job at the same moment, each
somewhere in its step, and Python runs the handler at the next bytecode of the main thread: inside FairScale's backward
hooks, or on a rank blocked in a collective only once it returns. Lightning 1.6.5 saved the checkpoint inside the
handler, there (FSDP refuses a state dict in the middle of a step, so the save failed on every rank and the job was
never requeued), and requeued the job as soon as ``save_checkpoint`` returned, which with ``async_checkpoint=True``
is before the file is written. Here the handler only counts the signal. At the next training batch boundary the ranks
agree whether any of them was signalled; then every rank saves, the save is committed, and only then does global rank
0 run ``scontrol requeue``. Training goes on until Slurm ends the job, as in 1.6.5.

The hooks are ``SignalConnector.slurm_sigusr1_handler_fn``, whose body is :func:`_record_sigusr1`, and
``Trainer._exit_gracefully_on_signal``, which the loops call at their batch boundaries and which calls
:func:`_requeue_if_signalled`. The requeue itself is 1.6.5's code, ``SignalConnector._requeue_slurm_job``.
"""
# fork-feature: fork/slurm-requeue-after-save.patch
import logging

import torch

import pytorch_lightning as pl
from pytorch_lightning.plugins.environments import SLURMEnvironment
from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_process_group
from pytorch_lightning.utilities.exceptions import CheckpointError
from pytorch_lightning.utilities.rank_zero import rank_zero_info

log = logging.getLogger(__name__)


def _record_sigusr1(connector: "pl.trainer.connectors.signal_connector.SignalConnector") -> None:
    """The body of the ``SIGUSR1`` handler: counts the signal, nothing else. The handler runs wherever the main
    thread is (in the middle of a backward pass, of a collective's Python wrapper, of a log call), so it takes no lock,
    calls no collective and cannot fail; :func:`_requeue_if_signalled` acts on the count at the next boundary. A
    count rather than a flag, so that a signal that arrives while a boundary reads it is not cleared unseen.

    Args:
        connector: the trainer's ``SignalConnector``.
    """
    connector._sigusr1_received = getattr(connector, "_sigusr1_received", 0) + 1


def _requeue_if_signalled(trainer: "pl.Trainer") -> None:
    """At a batch boundary: if ``SIGUSR1`` reached any rank since the last time, every rank saves the HPC checkpoint
    (:func:`_save_then_requeue`). Collective while Slurm's auto-requeue is on and more than one process runs: the loops
    call it at the same boundaries on every rank.

    It acts at training batch boundaries only (after each training batch and at the end of an epoch), and only where a
    checkpoint resumes cleanly (:func:`_resumes_cleanly_from_here`). A signal that arrives during a validation run is
    handled after the next training batch: a checkpoint saved in the middle of the run would resume it partway (1.6.5's
    loops count the batches already done and take the rest from the start of the dataloader) without the metrics
    ``ModelCheckpoint`` monitors for it, and the ranks need not run the same number of validation batches, so an
    agreement between them there could hang. Outside ``fit`` nothing is saved or requeued.

    Args:
        trainer: the trainer whose loops reached a boundary.
    """
    if not trainer.training or not _auto_requeue(trainer) or not _resumes_cleanly_from_here(trainer):
        return
    connector = trainer._signal_connector
    received = getattr(connector, "_sigusr1_received", 0)
    if not _any_rank_signalled(trainer, received > getattr(connector, "_sigusr1_handled", 0)):
        return
    _save_then_requeue(trainer)
    # Slurm sends one signal to every task: those counted until now, also on a rank whose handler ran only once the
    # agreement's collective returned, are the one this save answered
    connector._sigusr1_handled = getattr(connector, "_sigusr1_received", 0)


def _resumes_cleanly_from_here(trainer: "pl.Trainer") -> bool:
    """Whether a checkpoint saved at this boundary resumes as if training had not stopped: not in the middle of a
    gradient-accumulation window (the accumulated gradients are not saved), and not right after a validation run
    (1.6.5's loops run that validation again on resume, with no metrics for ``EarlyStopping`` and ``ModelCheckpoint``,
    which raise or save nothing). The same on every rank: it depends on the loop's progress only."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if epoch_loop._should_accumulate():
        return False
    return not epoch_loop._should_check_val_fx(epoch_loop.batch_idx, epoch_loop.batch_progress.is_last_batch)


def _auto_requeue(trainer: "pl.Trainer") -> bool:
    """Whether the trainer requeues the job on Slurm's ``SIGUSR1``, as ``SignalConnector`` decides it."""
    environment = trainer._accelerator_connector.cluster_environment
    on_windows = trainer._signal_connector._is_on_windows()  # no SIGUSR1 there
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue and not on_windows


def _any_rank_signalled(trainer: "pl.Trainer", signalled: bool) -> bool:
    """Whether ``signalled`` is true on any rank. Collective when more than one process runs: over the strategy's
    gloo checkpoint group if it has one, at this boundary; else over the default process group (NCCL), where a
    blocking check would synchronise the device at every batch, pipelined: each boundary starts the reduction of this
    rank's flag without waiting for it and acts on the one the previous boundary started, one batch later.

    Args:
        trainer: the trainer whose ranks agree.
        signalled: whether this rank got the signal.
    """
    if trainer.world_size < 2:
        return signalled
    try:
        group = _checkpoint_process_group(trainer.strategy)
    except CheckpointError:
        # closed by a save that timed out at its arrival, on every rank: training goes on, and so does the check
        group = None
    if group is None:
        return _any_rank_signalled_one_boundary_later(trainer, signalled)
    flag = torch.tensor([int(signalled)], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())


class _PendingFlags:
    """The reduction of the ranks' flags over the default process group, started at one boundary and read at the
    next: the flag is copied to host memory behind it on the device's stream, and a CUDA event marks the copy, so
    that reading it waits for the work queued up to that boundary (the previous step, usually done by then), not for
    the work queued since."""

    def __init__(self, device: torch.device, signalled: bool) -> None:
        # filled on the device: a tensor copied from host memory would synchronise the stream
        flag = torch.full((1,), int(signalled), dtype=torch.int32, device=device)
        self._work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self._event = None
        if device.type == "cuda":
            self._work.wait()  # the current stream waits for the reduction; the host does not
            self._flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._flag.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._flag = flag

    def any_set(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        else:
            self._work.wait()
        return bool(self._flag.item())


def _any_rank_signalled_one_boundary_later(trainer: "pl.Trainer", signalled: bool) -> bool:
    """See :func:`_any_rank_signalled`. Every rank reads the same reduction at the same boundary, so they decide
    alike. After a decision to save, no reduction is started at that boundary: the signals it would report are the
    ones being handled."""
    connector = trainer._signal_connector
    pending = getattr(connector, "_sigusr1_pending", None)
    decided = pending is not None and pending.any_set()
    connector._sigusr1_pending = None if decided else _PendingFlags(trainer.strategy.root_device, signalled)
    return decided


def _save_then_requeue(trainer: "pl.Trainer") -> None:
    """Every rank saves the HPC checkpoint and waits until it is committed; then global rank 0 requeues the job.

    A save that fails (``CheckpointError``, on every rank with FSDP or DeepSpeed, else on global rank 0, which
    writes) is logged as an error and the job is requeued all the same: saves are atomic, so the newest HPC
    checkpoint on disk is still the previous complete one, and the requeued job resumes from it (or starts as it was
    started, if there is none). Not requeueing would let Slurm end the job at its time limit for good, losing the
    progress up to that checkpoint as well. A save that fails every time (a full disk) thus repeats the same stretch of
    training in each requeued job; the error in the log says so. Other exceptions, such as a
    ``MisconfigurationException``, propagate as in 1.6.5, and the job is not requeued.

    Args:
        trainer: the trainer whose ranks all got here.
    """
    hpc_save_path = trainer._checkpoint_connector.hpc_save_path(trainer._weights_save_path_internal)
    rank_zero_info(f"handling SIGUSR1: saving {hpc_save_path!r} at step {trainer.global_step}, then requeueing the job")
    # as in 1.6.5: the loggers write out every metric logged so far before the job ends; a logger that cannot (a full
    # disk) must not keep the checkpoint from being saved and the job from being requeued
    for logger in trainer.loggers:
        try:
            logger.finalize("finished")
        except Exception as error:
            log.error(f"Finalizing the logger {type(logger).__name__} for Slurm's SIGUSR1 failed: {error}")
    try:
        trainer.save_checkpoint(hpc_save_path)
        # ``async_checkpoint=True`` writes the file in the background: requeue once it is committed. Collective.
        wait_for_checkpoint = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if callable(wait_for_checkpoint):
            wait_for_checkpoint()
    except CheckpointError as error:
        log.error(
            f"Saving the HPC checkpoint for Slurm's SIGUSR1 failed on global rank {trainer.global_rank}; the job is"
            " requeued all the same and resumes from the newest complete HPC checkpoint in"
            f" {trainer._weights_save_path_internal!r} (as it was started, if there is none): {error}"
        )
    trainer._signal_connector._requeue_slurm_job()
