"""Multi-process scenarios of the parallel FSDP save (``DDPFullyShardedStrategy(checkpoint_writers="all")``) on CPU,
run as ``python -m tests.strategies.fsdp_parallel_save_scenarios``; driven by
``test_ddp_fully_sharded_parallel_save.py``.

Every rank's ``os.pwrite`` calls into the temporary file are recorded while the ranks write their shards, and global
rank 0 records the byte ranges of the file's FSDP records, so that the test can check that the ranks' blocks are
disjoint and cover every FSDP byte. ``--writers rank0`` runs the same scenarios with today's writer, and
``--writers default`` with the strategy's default (``default_writers`` records who wrote).

``async_equals_gathered`` and ``async_fails_while_writing`` do the same with ``async_checkpoint=True``, saving inside
``fit``: the writes then come from the ranks' background threads, which also count their gathers.
"""
import argparse
import errno
import functools
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from unittest import mock

import torch

from fsdp_harness.scenario import main, quiet_trainer_kwargs
from fsdp_harness.tensor_compare import iter_tensors
from pytorch_lightning import Callback, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import (
    fsdp_checkpointer,
    fsdp_parallel_save,
    fsdp_streaming_save,
    fsdp_writer_decision,
)
from pytorch_lightning.utilities import streamed_checkpoint_file
from pytorch_lightning.utilities.checkpoint_errors import CHECKPOINT_TIMEOUT_ENV
from pytorch_lightning.utilities.exceptions import CheckpointError
from fsdp_harness.models import FSDPModel
from tests.strategies.fsdp_stream_scenarios import (
    default_strategy,
    differences,
    load,
    saves_over_it_with_faults,
    strategy,
    TiedFSDPModel,
)
from tests.strategies.fsdp_async_scenarios import WRITER_THREAD
from tests.strategies.fsdp_writer_decision_scenarios import LogLines

#: byte ranges written into ``*.tmp`` files while the ranks write their shards, and the FSDP records' ranges
Ranges = List[Tuple[int, int]]


@contextmanager
def recording_writes(writes: Ranges, records: Ranges, threads: Optional[List[str]] = None) -> Iterator[None]:
    """Record every ``os.pwrite`` into a temporary checkpoint file once the structure is written (``writes``, and the
    name of the thread that made each in ``threads``), and on global rank 0 the byte ranges of the FSDP records of
    the structure (``records``). Global rank 0's CRC-32 fields, written through a new descriptor once every rank
    closed its own, are not recorded."""
    pwrite, writing, crcs = os.pwrite, [], []

    def recorded(fd: int, data: Any, offset: int) -> int:
        written = pwrite(fd, data, offset)
        if writing and not crcs and os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            writes.append((offset, written))
            if threads is not None:
                threads.append(threading.current_thread().name)
        return written

    def write_units(strategy: Any, stream: Any, writer: Any, *args: Any, **kwargs: Any) -> None:
        if writer is not None:
            records.extend(
                (writer.offset_of(p), p.numel() * p.element_size())
                for p in list(stream.model.values()) + list(stream.optimizer_placeholders.values())
            )
        writing.append(1)
        return original(strategy, stream, writer, *args, **kwargs)

    save = fsdp_streaming_save._save_checkpoint_if_streamed
    original = None

    def save_recording(strategy: Any, checkpoint: Any, filepath: Any, units_writer: Any, *plan: Any) -> bool:
        nonlocal original
        original = units_writer
        return save(strategy, checkpoint, filepath, write_units, *plan)

    write_crcs = streamed_checkpoint_file._write_record_crcs

    def writing_crcs(*args: Any) -> None:
        crcs.append(1)
        try:
            write_crcs(*args)
        finally:
            crcs.clear()

    with mock.patch.object(os, "pwrite", recorded), mock.patch(
        "pytorch_lightning.strategies.fsdp_checkpointer._save_checkpoint_if_streamed", save_recording
    ), mock.patch.object(streamed_checkpoint_file, "_write_record_crcs", writing_crcs):
        yield


def make_model(args: argparse.Namespace) -> FSDPModel:
    """The streamed save's test model, of width ``args.width``: at 72 a weight's record spans several 4 KiB blocks
    and the ranks' shards end inside it; at 16 many records share a block."""
    model_class = TiedFSDPModel if args.model == "tied" else FSDPModel
    return model_class(
        width=args.width, units=3, wrapping=args.wrapping, extra_before=True, extra_after=True,
        optimizer=args.optimizer, scheduler=True,
    )


def fit(
    args: argparse.Namespace, epochs: int = 2, async_checkpoint: bool = False, **kwargs: Any
) -> Tuple[Trainer, Any]:
    seed_everything(5)
    model = make_model(args)
    if args.writers == "default":
        writers = default_strategy(async_checkpoint=async_checkpoint)
    else:
        writers = strategy(args, checkpoint_writers=args.writers, async_checkpoint=async_checkpoint)
    trainer = Trainer(
        **quiet_trainer_kwargs(
            args.out, args.devices, accelerator=args.accelerator, strategy=writers, max_epochs=epochs, **kwargs
        )
    )
    trainer.fit(model)
    return trainer, model


def parallel_equals_gathered(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit, save with ``args.writers`` (recording the writes) and gathered; rank 0 compares the files."""
    trainer, _ = fit(args)
    writes: Ranges = []
    records: Ranges = []
    with recording_writes(writes, records):
        trainer.save_checkpoint(args.out / "parallel.ckpt")
    trainer.strategy.stream_checkpoint = False
    trainer.save_checkpoint(args.out / "gathered.ckpt")
    result: Dict[str, Any] = {"rank": trainer.global_rank, "writes": writes, "records": records}
    result["checkpoint_writers"] = trainer.strategy.checkpoint_writers
    if trainer.global_rank == 0:
        parallel, gathered = load(args.out / "parallel.ckpt"), load(args.out / "gathered.ckpt")
        result["differences"] = differences(parallel, gathered)
        result["tensors"] = len(list(iter_tensors(gathered)))
        result["temporary_files"] = sorted(p.name for p in args.out.glob("*.tmp"))
    return result


@contextmanager
def counting_calls(owner: Any, name: str, calls: List[int]) -> Iterator[None]:
    """Count the calls of ``owner.<name>`` in ``calls``, calling through."""
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    with mock.patch.object(owner, name, counted):
        yield


def default_writers(args: argparse.Namespace) -> Dict[str, Any]:
    """``parallel_equals_gathered`` with the strategy's default ``checkpoint_writers``, recording whether every rank
    wrote its own shards (the parallel writer ran), how many probe files global rank 0 wrote, and the info lines
    about ``checkpoint_writers``."""
    parallel_writer: List[int] = []
    probes: List[int] = []
    lines = LogLines()
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(lines)
    try:
        with counting_calls(fsdp_checkpointer, "_write_units_by_every_rank", parallel_writer), counting_calls(
            fsdp_writer_decision, "_write_probe", probes
        ):
            result = parallel_equals_gathered(args)
    finally:
        logger.removeHandler(lines)
    result.update(
        parallel_writer=len(parallel_writer),
        probes=len(probes),
        info=[line for line in lines.lines if "checkpoint_writers" in line],
    )
    return result


@contextmanager
def counting_gathers(gathers: List[int]) -> Iterator[None]:
    """Count the ``torch.distributed.gather`` calls of this rank's background writer thread in ``gathers``."""
    gather = torch.distributed.gather

    # keeps ``gather``'s signature: the strategy checks that the collectives take a ``group``
    @functools.wraps(gather)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == WRITER_THREAD:
            gathers.append(1)
        return gather(*args, **kwargs)

    with mock.patch.object(torch.distributed, "gather", counted):
        yield


def async_equals_gathered(args: argparse.Namespace) -> Dict[str, Any]:
    """With ``async_checkpoint=True``, at the end of the last epoch of ``fit``: save with ``args.writers`` in the
    background (recording the writes, their threads and the writer thread's gathers) and wait for it, then save
    gathered; rank 0 compares the files. ``ModelCheckpoint(save_top_k=1, save_last=True)`` saves in the background
    every epoch around them."""
    writes: Ranges = []
    records: Ranges = []
    threads: List[str] = []
    gathers: List[int] = []
    result: Dict[str, Any] = {"writes": writes, "records": records}

    class SaveBoth(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
            if trainer.current_epoch != trainer.max_epochs - 1:
                return
            with recording_writes(writes, records, threads), counting_gathers(gathers):
                trainer.save_checkpoint(args.out / "parallel.ckpt")
                result["in_flight"] = trainer.strategy._checkpoint_state.in_flight is not None
                trainer.strategy.wait_for_checkpoint()
            trainer.strategy.stream_checkpoint = False
            trainer.save_checkpoint(args.out / "gathered.ckpt")
            trainer.strategy.stream_checkpoint = True

    folder = args.out / "model_checkpoint"
    callbacks = [SaveBoth(), ModelCheckpoint(dirpath=str(folder), save_top_k=1, save_last=True)]
    trainer, _ = fit(args, async_checkpoint=True, callbacks=callbacks, enable_checkpointing=True)
    result.update(rank=trainer.global_rank, threads=sorted(set(threads)), gathers=len(gathers))
    if trainer.global_rank == 0:
        parallel, gathered = load(args.out / "parallel.ckpt"), load(args.out / "gathered.ckpt")
        result["differences"] = differences(parallel, gathered)
        result["tensors"] = len(list(iter_tensors(gathered)))
        result["temporary_files"] = sorted(p.name for p in args.out.rglob("*.tmp"))
        result["model_checkpoint"] = {p.name: load(p)["epoch"] for p in sorted(folder.glob("*.ckpt"))}
    return result


def resume(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from ``args.ckpt`` (written by ``parallel_equals_gathered``) and save again gathered: the state
    loaded through the parallel load is saved as it was read."""
    seed_everything(5)
    model = make_model(args)
    trainer = Trainer(
        **quiet_trainer_kwargs(
            args.out, args.devices, accelerator=args.accelerator, strategy=strategy(args), max_epochs=2
        )
    )
    trainer.fit(model, ckpt_path=args.ckpt)  # max_epochs reached: restores, then stops
    trainer.strategy.stream_checkpoint = False
    trainer.save_checkpoint(args.out / "resumed.ckpt")
    result: Dict[str, Any] = {"rank": trainer.global_rank}
    if trainer.global_rank == 0:
        saved, resumed = load(args.ckpt), load(args.out / "resumed.ckpt")
        for checkpoint in (saved, resumed):
            checkpoint.pop("callbacks", None)
            checkpoint.pop("loops", None)
        result["differences"] = differences(resumed, saved)
        result["tensors"] = len(list(iter_tensors(saved)))
    return result


#: faults on rank 1: the ``os`` call into the temporary file that fails, and its error
FAULTS = {
    "full_disk": ("pwrite", errno.ENOSPC),
    # as where rank 1's checkpoint directory is node-local: rank 0's temporary file is not there
    "cannot_open": ("open", errno.ENOENT),
    # rank 1 runs out of host memory as it allocates the buffers of the block-boundary exchange
    "no_memory": ("empty", errno.ENOMEM),
}


def _in_block_exchange() -> bool:
    """Whether the caller's caller runs in the allocation of the block-boundary exchange's buffers."""
    frame = sys._getframe(2)
    for _ in range(3):  # the allocation's comprehension, then the method
        if frame is None:
            return False
        if frame.f_code.co_name == "prepare" and frame.f_globals.get("__name__") == fsdp_parallel_save.__name__:
            return True
        frame = frame.f_back
    return False


@contextmanager
def failing_on_rank_1(trainer: Trainer, fault: str) -> Iterator[None]:
    """On global rank 1, ``os.<call>`` of ``FAULTS[fault]`` fails on a temporary checkpoint file with its error; or
    ``torch.empty`` fails in the block-boundary exchange as torch's CPU allocator fails when ``malloc`` does."""
    call, code = FAULTS[fault]
    owner = torch if call == "empty" else os
    original = getattr(owner, call)

    def failing(target: Any, *args: Any, **kwargs: Any) -> Any:
        path = os.readlink(f"/proc/self/fd/{target}") if isinstance(target, int) else os.fspath(target)
        if path.endswith(".tmp"):
            raise OSError(code, os.strerror(code))
        return original(target, *args, **kwargs)

    def failing_allocation(*args: Any, **kwargs: Any) -> Any:
        if _in_block_exchange():
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to"
                f" allocate {args[0] if args else 0} bytes. Error code {code} ({os.strerror(code)})"
            )
        return original(*args, **kwargs)

    patched = failing_allocation if owner is torch else failing
    with mock.patch.object(owner, call, patched) if trainer.global_rank == 1 else mock.patch.dict({}):
        yield


def fails_while_writing(args: argparse.Namespace) -> Dict[str, Any]:
    """Save; then, for each fault of ``FAULTS``, change the weights and save over it with that fault on rank 1, and
    report what every rank raised and whether the file is unchanged. Then save again."""
    trainer, model = fit(args, epochs=1)
    path = args.out / "last.ckpt"
    return saves_over_it_with_faults(trainer, model, path, args.out, FAULTS, failing_on_rank_1)


def async_fails_while_writing(args: argparse.Namespace) -> Dict[str, Any]:
    """``fails_while_writing`` with ``async_checkpoint=True``, inside ``fit``: each save goes to the background, where
    rank 1's writer thread meets the fault, and ``wait_for_checkpoint`` raises it."""
    result: Dict[str, Any] = {"in_background": []}

    class SavesWithFaults(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
            def save(path: Any) -> None:
                trainer.save_checkpoint(path)
                result["in_background"].append(trainer.strategy._checkpoint_state.in_flight is not None)
                trainer.strategy.wait_for_checkpoint()

            path = args.out / "last.ckpt"
            faults = saves_over_it_with_faults(trainer, pl_module, path, args.out, FAULTS, failing_on_rank_1, save)
            result.update(faults)

    fit(args, epochs=1, async_checkpoint=True, callbacks=[SavesWithFaults()])
    return result


@contextmanager
def stopping_rank_1_in_pwrite(trainer: Trainer, out: Any, stop: Callable[[], None]) -> Iterator[None]:
    """On global rank 1, the first ``os.pwrite`` into a temporary checkpoint file (of a shard: global rank 0 writes
    the structure) writes half its bytes, writes the time to ``out/fault_time``, calls ``stop()`` (which kills the
    rank, or stalls it), writes the time to ``out/resumed_time`` and writes the rest."""
    pwrite, stopped = os.pwrite, []

    def stopping(fd: int, data: Any, offset: int) -> int:
        if stopped or not os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            return pwrite(fd, data, offset)
        stopped.append(1)
        view = memoryview(data).cast("B")
        half = pwrite(fd, view[: len(view) // 2], offset)
        (out / "fault_time").write_text(repr(time.time()))
        stop()
        (out / "resumed_time").write_text(repr(time.time()))
        return half + pwrite(fd, view[half:], offset + half)

    with mock.patch.object(os, "pwrite", stopping) if trainer.global_rank == 1 else mock.patch.dict({}):
        yield


@contextmanager
def stopping_rank_1_in_exchange(trainer: Trainer, out: Any, stop: Callable[[], None]) -> Iterator[None]:
    """On global rank 1, the exchange of the block-boundary bytes writes the time to ``out/fault_time`` and calls
    ``stop()`` (which kills the rank) before it sends or receives anything."""
    run = fsdp_parallel_save._BlockExchange.run

    def stopping(exchange: Any, group: Any) -> None:
        (out / "fault_time").write_text(repr(time.time()))
        stop()
        run(exchange, group)

    patched = mock.patch.object(fsdp_parallel_save._BlockExchange, "run", stopping)
    with patched if trainer.global_rank == 1 else mock.patch.dict({}):
        yield


@contextmanager
def stopping_rank_1_in_structure(trainer: Trainer, out: Any, stop: Callable[[], None]) -> Iterator[None]:
    """Rank 1 is lost while global rank 0 writes the checkpoint's structure: on rank 1, the streamed save's step that
    waits for it writes the time to ``out/fault_time`` and its pid to ``out/rank1.pid``, and calls ``stop()`` (which
    kills the rank); rank 0 begins that step (writing the structure) once rank 1's process has exited, so that its
    wait for the other ranks after the structure is what fails, whatever the timing of rank 1's exit."""
    write_skeleton = fsdp_streaming_save._write_streamed_skeleton

    def stopping(*args: Any, **kwargs: Any) -> Any:
        (out / "fault_time").write_text(repr(time.time()))
        (out / "rank1.pid").write_text(str(os.getpid()))
        stop()
        return write_skeleton(*args, **kwargs)

    def after_rank_1_exited(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _exited(out / "rank1.pid"):
            time.sleep(0.05)
        return write_skeleton(*args, **kwargs)

    wrapper = stopping if trainer.global_rank == 1 else after_rank_1_exited
    with mock.patch.object(fsdp_streaming_save, "_write_streamed_skeleton", wrapper):
        yield


def _exited(pid_file: Any) -> bool:
    """Whether the process whose pid ``pid_file`` holds has exited (gone, or a zombie: its sockets are closed)."""
    if not pid_file.exists() or not pid_file.read_text():
        return False
    try:
        with open(f"/proc/{pid_file.read_text()}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def saves_over_it(
    args: argparse.Namespace, around: Callable[[Trainer], Any], directory: Path
) -> Tuple[Dict[str, Any], Trainer, Any]:
    """Fit and save ``directory/last.ckpt``; change the weights and save over it inside ``around(trainer)``; the
    record: what this rank raised and when, and on rank 0 whether the file is unchanged and which temporary files
    are left."""
    trainer, model = fit(args, epochs=1)
    path = directory / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes() if trainer.global_rank == 0 else b""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    result: Dict[str, Any] = {"rank": trainer.global_rank, "raised": None}
    with around(trainer):
        try:
            trainer.save_checkpoint(path)
        except CheckpointError as ex:
            result["raised"] = str(ex)
    result["raised_time"] = time.time()
    if trainer.global_rank == 0:
        result["unchanged"] = path.read_bytes() == before
        result["temporary_files"] = sorted(p.name for p in directory.glob("*.tmp"))
    return result, trainer, model


def saves_over_it_with_rank_1_stopped(
    args: argparse.Namespace, stop: Callable[[], None], where: Callable[..., Any] = stopping_rank_1_in_pwrite
) -> Tuple[Dict[str, Any], Trainer, Any]:
    """:func:`saves_over_it` in ``--out`` while rank 1 is stopped in its ``pwrite`` (see
    :func:`stopping_rank_1_in_pwrite`), or where ``where`` says."""
    return saves_over_it(args, lambda trainer: where(trainer, args.out, stop), args.out)


def killed_while_writing(args: argparse.Namespace) -> Dict[str, Any]:
    """Rank 1 is killed (SIGKILL) in its ``pwrite`` of a shard into the temporary file of a save over a previous
    checkpoint (``--killed-in exchange``: in the exchange of the block-boundary bytes, before it; ``structure``: while
    rank 0 writes the checkpoint's structure, before both); rank 0 goes on alone and records what it raised."""
    where = {
        "pwrite": stopping_rank_1_in_pwrite,
        "exchange": stopping_rank_1_in_exchange,
        "structure": stopping_rank_1_in_structure,
    }[args.killed_in]
    result, _, _ = saves_over_it_with_rank_1_stopped(args, lambda: os.kill(os.getpid(), signal.SIGKILL), where)
    return result


class _Stop(Exception):
    """Ends ``fit`` on the surviving rank once it has recorded what it raised."""


def async_killed_while_writing(args: argparse.Namespace) -> Dict[str, Any]:
    """With ``async_checkpoint=True``, inside ``fit`` and with ``PL_CHECKPOINT_TIMEOUT`` set to ``--timeout``
    seconds: save ``last.ckpt`` and wait for it; change the weights and save over it in the background while rank
    1's writer thread is killed (SIGKILL, the whole process) in its ``pwrite`` of a shard; rank 0 records what
    ``wait_for_checkpoint`` raised and when, whether the file is unchanged and which temporary files are left, then
    ends ``fit`` alone."""
    os.environ[CHECKPOINT_TIMEOUT_ENV] = str(args.timeout)
    result: Dict[str, Any] = {"rank": None, "raised": None, "in_background": []}

    class SavesOverItWithRank1Killed(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
            path = args.out / "last.ckpt"
            result["rank"] = trainer.global_rank
            trainer.save_checkpoint(path)
            trainer.strategy.wait_for_checkpoint()
            before = path.read_bytes() if trainer.global_rank == 0 else b""
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(1.0)
            with stopping_rank_1_in_pwrite(trainer, args.out, lambda: os.kill(os.getpid(), signal.SIGKILL)):
                trainer.save_checkpoint(path)
                result["in_background"].append(trainer.strategy._checkpoint_state.in_flight is not None)
                try:
                    trainer.strategy.wait_for_checkpoint()
                except CheckpointError as ex:
                    result["raised"] = str(ex)
            result["raised_time"] = time.time()
            result["unchanged"] = path.read_bytes() == before
            result["temporary_files"] = sorted(p.name for p in args.out.glob("*.tmp"))
            raise _Stop()

    try:
        fit(args, epochs=1, async_checkpoint=True, callbacks=[SavesOverItWithRank1Killed()])
    except _Stop:
        pass
    finally:
        del os.environ[CHECKPOINT_TIMEOUT_ENV]
    return result


def slow_writer(args: argparse.Namespace) -> Dict[str, Any]:
    """With ``PL_CHECKPOINT_TIMEOUT`` set to ``--timeout`` seconds for this scenario (read when ``fit`` sets up its
    checkpoint group), rank 1 stalls in its ``pwrite`` of a shard for ``--stall`` seconds; then the ranks validate
    (a new ``Trainer`` stage, which replaces the checkpoint group the failure closed) and save again."""
    os.environ[CHECKPOINT_TIMEOUT_ENV] = str(args.timeout)
    try:
        result, trainer, model = saves_over_it_with_rank_1_stopped(args, lambda: time.sleep(args.stall))
    finally:
        del os.environ[CHECKPOINT_TIMEOUT_ENV]
    trainer.validate(model, verbose=False)
    trainer.save_checkpoint(args.out / "after.ckpt")
    if trainer.global_rank == 0:
        result["after_loads"] = len(load(args.out / "after.ckpt")["state_dict"])
    return result


#: the object collectives a parallel save may run
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object")


@contextmanager
def counting_save_costs(costs: Dict[str, Any]) -> Iterator[None]:
    """Count, on this rank, the reads of the mount table (``psutil.disk_partitions``), the flag exchanges (every
    ``torch.distributed.all_gather`` of a parallel save is one) and the object collectives, and record the size and
    the allocated bytes (``st_blocks``) of the temporary file just before this rank writes its shards."""
    import psutil

    costs.update(mount_table_reads=0, flag_exchanges=0, object_collectives=0)

    def counted(owner: Any, name: str, key: str) -> Any:
        original = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            costs[key] += 1
            return original(*args, **kwargs)

        return mock.patch.object(owner, name, call)

    write_own_shards = fsdp_parallel_save._write_own_shards

    def measured(strategy: Any, stream: Any, plan: Any, *args: Any) -> None:
        stat = os.stat(plan.table.path)
        costs.update(size=stat.st_size, allocated=stat.st_blocks * 512)
        return write_own_shards(strategy, stream, plan, *args)

    objects = [counted(torch.distributed, name, "object_collectives") for name in OBJECT_COLLECTIVES]
    with counted(psutil, "disk_partitions", "mount_table_reads"), counted(
        torch.distributed, "all_gather", "flag_exchanges"
    ), objects[0], objects[1], objects[2], mock.patch.object(fsdp_parallel_save, "_write_own_shards", measured):
        yield


def save_costs(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit and save once; then, counted (:func:`counting_save_costs`), save again over it: the fixed costs of one
    parallel save on this rank, and the temporary file's allocation before the ranks write their shards."""
    trainer, _ = fit(args, epochs=1)
    trainer.save_checkpoint(args.out / "last.ckpt")
    costs: Dict[str, Any] = {"rank": trainer.global_rank}
    with counting_save_costs(costs):
        trainer.save_checkpoint(args.out / "last.ckpt")
    return costs


def saves_on_filesystem(args: argparse.Namespace) -> Dict[str, Any]:
    """:func:`saves_over_it` in ``--ckpt-dir`` (a small real filesystem of the test's), then, where the second save
    was written, the differences between its file and a gathered save of the same state into ``--out``."""
    directory = Path(args.ckpt_dir)
    result, trainer, _ = saves_over_it(args, lambda trainer: nullcontext(), directory)
    trainer.strategy.stream_checkpoint = False
    trainer.save_checkpoint(args.out / "gathered.ckpt")
    if trainer.global_rank == 0 and result["raised"] is None:
        result["differences"] = differences(load(directory / "last.ckpt"), load(args.out / "gathered.ckpt"))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["plain", "tied"], default="tied")
    parser.add_argument("--wrapping", choices=["wrap", "auto_wrap"], default="wrap")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--writers", choices=["rank0", "all", "default"], default="all")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--ckpt-dir", default=None, help="saves_on_filesystem: the filesystem to save into")
    parser.add_argument(
        "--killed-in", choices=["pwrite", "exchange", "structure"], default="pwrite",
        help="killed_while_writing: kill rank 1 in its pwrite of a shard, in the exchange of the block-edge bytes, or"
        " while rank 0 writes the structure",
    )
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument(
        "--timeout", type=float, default=2.0, help="PL_CHECKPOINT_TIMEOUT of slow_writer and async_killed_while_writing"
    )
    parser.add_argument("--stall", type=float, default=5.0, help="seconds rank 1 stalls in slow_writer")


if __name__ == "__main__":
    main(
        {
            "parallel_equals_gathered": parallel_equals_gathered,
            "default_writers": default_writers,
            "resume": resume,
            "fails_while_writing": fails_while_writing,
            "async_equals_gathered": async_equals_gathered,
            "async_fails_while_writing": async_fails_while_writing,
            "killed_while_writing": killed_while_writing,
            "async_killed_while_writing": async_killed_while_writing,
            "slow_writer": slow_writer,
            "save_costs": save_costs,
            "saves_on_filesystem": saves_on_filesystem,
        },
        add_arguments,
    )
