"""Shared-file write benchmark: ``python -m fsdp_benchmarks.shared_file_writes --dir DIR [--procs 1,2,4] [--mb 128]
[--repeats 3] [--json OUT]`` (or ``python fsdp_benchmarks/shared_file_writes.py ...``).

Does the filesystem at ``DIR`` let several processes of one host write their own byte ranges of ONE file at once, as
the parallel save (``checkpoint_writers="all"``) does, or does it run them one after the other? Linux's buffered
write path takes the file's inode lock for each ``write``/``pwrite`` on most local filesystems (ext4, XFS, tmpfs) and
on NFS clients, so the ranks of one node copy their bytes into one file one at a time; other clients (Lustre, GPFS)
lock differently, which this measures. Separate files (one per rank, as torch DCP writes) do not share that lock.

For each number of processes P, P processes start together (a barrier) and each writes ``--mb`` MiB in 8 MiB
``pwrite`` calls, then ``fdatasync``-s, in each of four modes (:data:`MODES`), alternating their order ``--repeats``
times:

- "sparse": its own range of one file that has only its final size (holes), as the parallel save's temporary file is
  where it is not preallocated;
- "preallocated": the same, into a file whose blocks were allocated first (``fallocate(2)`` itself, as the parallel
  save prepares it on ext4 and XFS); "refused" where the filesystem does not take ``fallocate``;
- "direct": the preallocated file again, opened with ``O_DIRECT`` and written from a page-aligned buffer (ext4 and
  XFS run direct overwrites of allocated blocks concurrently); "refused" where the filesystem does not take
  ``O_DIRECT`` or ``fallocate``;
- "own files": a file of its own, as torch DCP writes.

Reported: the median over the repeats of the slowest process's seconds for each mode, and each one-file mode's ratio
to "own files" (about 1 where the writes run in parallel, up to P where they are serialized). Every byte of every
file is read back and checked; the exit code is non-zero when one is wrong or a process fails. Nothing here imports
Lightning: it measures the filesystem alone.
"""
import argparse
import ctypes
import errno
import json
import mmap
import multiprocessing
import multiprocessing.connection
import os
import queue
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

MIB = 2**20
CHUNK = 8 * MIB
#: the ways to write (see the module's docstring); the first three write into one file
MODES = ("sparse", "preallocated", "direct", "own files")
SHARED_MODES = MODES[:3]
#: the mode the one-file modes are compared with
OWN_FILES = "own files"


def parse_procs(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--procs expects positive integers such as 4 or 1,2,4, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_benchmarks.shared_file_writes", description=__doc__.split("\n\n")[1].replace("\n", " ")
    )
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the filesystem to measure")
    parser.add_argument("--procs", type=parse_procs, default=[1, 2, 4], help="processes, or a list such as 1,2,4")
    parser.add_argument("--mb", type=int, default=128, help="MiB each process writes (a multiple of 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode per number of processes")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run of P processes may take")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser


def _chunk_stamp(process: int, chunk: int) -> bytes:
    """The first 8 bytes of every chunk: which process wrote it and its index, so a misplaced chunk is found."""
    return struct.pack("<II", process, chunk)


def _path(directory: Path, mode: str, process: int) -> Path:
    return directory / ("shared.bin" if mode in SHARED_MODES else f"own-{process}.bin")


def _offset(mode: str, process: int, chunks: int) -> int:
    return process * chunks * CHUNK if mode in SHARED_MODES else 0


def _fallocate(fd: int, length: int) -> None:
    """``fallocate(2)`` itself, as the parallel save calls it: glibc's ``posix_fallocate`` would write into every
    block where the filesystem refuses the call."""
    if ctypes.CDLL(None, use_errno=True).fallocate64(fd, 0, ctypes.c_int64(0), ctypes.c_int64(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _prepare_shared_file(directory: Path, mode: str, procs: int, chunks: int) -> None:
    """The one file of a shared mode, made before the processes start, as global rank 0 makes the temporary file:
    with its final size (a sparse file), or with its blocks allocated."""
    with open(_path(directory, mode, 0), "wb") as file:
        if mode == "sparse":
            file.truncate(procs * chunks * CHUNK)
        else:
            _fallocate(file.fileno(), procs * chunks * CHUNK)


def _refusals(directory: Path) -> Dict[str, str]:
    """The modes the filesystem at ``directory`` does not take, and why: ``fallocate`` refused (then also "direct",
    which writes into a preallocated file), ``O_DIRECT`` refused."""
    path, buffer = directory / "probe.bin", mmap.mmap(-1, mmap.PAGESIZE)
    refused: Dict[str, str] = {}
    try:
        with open(path, "wb") as file:
            _fallocate(file.fileno(), mmap.PAGESIZE)
    except OSError as ex:
        if ex.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        refused["preallocated"] = refused["direct"] = f"fallocate refused ({errno.errorcode[ex.errno]})"
    try:
        if "direct" not in refused:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            try:
                os.pwrite(fd, buffer, 0)
            finally:
                os.close(fd)
    except OSError as ex:
        if ex.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        refused["direct"] = f"O_DIRECT refused ({errno.errorcode[ex.errno]})"
    finally:
        buffer.close()
        path.unlink(missing_ok=True)
    return refused


def _write(directory: Path, mode: str, process: int, chunks: int, start: Any, results: Any) -> None:
    """One process: its chunks into its range of the file of ``mode``, timed from the barrier to ``fdatasync``."""
    # page-aligned, as O_DIRECT needs; the other modes write from the same kind of buffer
    buffer = mmap.mmap(-1, CHUNK)
    buffer.write(bytes([process % 251 + 1]) * CHUNK)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if mode == "direct" else 0)
    fd = os.open(_path(directory, mode, process), flags, 0o644)
    try:
        base = _offset(mode, process, chunks)
        start.wait()
        began = time.perf_counter()
        for chunk in range(chunks):
            buffer[:8] = _chunk_stamp(process, chunk)
            view, offset = memoryview(buffer), base + chunk * CHUNK
            while view:  # pwrite may write fewer bytes than asked
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
        os.fdatasync(fd)
        results.put((process, time.perf_counter() - began))
    finally:
        os.close(fd)


def _verify(directory: Path, mode: str, procs: int, chunks: int) -> List[str]:
    """What is wrong in the files of one run: every chunk must hold its writer's stamp and fill byte."""
    errors = []
    for process in range(procs):
        fill = bytes([process % 251 + 1]) * (CHUNK - 8)
        with open(_path(directory, mode, process), "rb") as file:
            file.seek(_offset(mode, process, chunks))
            for chunk in range(chunks):
                data = file.read(CHUNK)
                if data[:8] != _chunk_stamp(process, chunk) or data[8:] != fill:
                    errors.append(f"{mode}, process {process}, chunk {chunk}: not the bytes written")
    return errors


def run_once(directory: Path, mode: str, procs: int, chunks: int, timeout: float) -> Dict[str, Any]:
    """P processes write together in ``mode``; the slowest one's seconds and what the check found. A process that
    fails breaks the barrier, so the others stop too instead of waiting for it until ``timeout``."""
    for stale in directory.glob("*.bin"):
        stale.unlink()
    if mode in SHARED_MODES:
        _prepare_shared_file(directory, mode, procs, chunks)
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(procs), context.Queue()
    workers = [context.Process(target=_write, args=(directory, mode, p, chunks, start, results)) for p in range(procs)]
    for worker in workers:
        worker.start()
    deadline, running = time.monotonic() + timeout, list(workers)
    while running and time.monotonic() < deadline:
        multiprocessing.connection.wait([w.sentinel for w in running], timeout=max(0.0, deadline - time.monotonic()))
        running = [w for w in running if w.exitcode is None]
        # over every worker, after the filter: a worker's sentinel closes before its exit status can be read, so one
        # that failed may leave ``running`` only at a later pass
        if any(w.exitcode not in (None, 0) for w in workers):
            start.abort()
    hung = [p for p, worker in enumerate(workers) if worker.exitcode is None]
    for p in hung:
        workers[p].kill()
        workers[p].join()
    failed = [p for p, worker in enumerate(workers) if worker.exitcode != 0 and p not in hung]
    seconds: Dict[int, float] = {}
    for _ in range(procs - len(hung) - len(failed)):
        try:
            process, took = results.get(timeout=10)
        except queue.Empty:
            break
        seconds[process] = took
    errors = [f"process {p} did not finish within {timeout:g} s" for p in hung]
    errors += [f"process {p} exited with {workers[p].exitcode}" for p in failed]
    if not errors:
        errors = _verify(directory, mode, procs, chunks)
    return {"seconds": max(seconds.values()) if len(seconds) == procs else None, "errors": errors}


def filesystem_of(directory: Path) -> str:
    """The type of the filesystem mounted at the longest mount point above ``directory`` (``psutil``)."""
    path = os.path.realpath(directory)
    mounts = [p for p in psutil.disk_partitions(all=True) if path == p.mountpoint or path.startswith(
        os.path.join(p.mountpoint, ""))]
    # the last of equally long mount points is the one mounted over the others
    return max(reversed(mounts), key=lambda p: len(p.mountpoint)).fstype if mounts else "unknown"


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    directory = args.dir / f"shared-file-writes-{os.getpid()}"
    directory.mkdir(parents=True)
    chunks = args.mb * MIB // CHUNK
    rows = []
    try:
        refused = _refusals(directory)
        modes = [mode for mode in MODES if mode not in refused]
        for procs in args.procs:
            runs: Dict[str, List[Optional[float]]] = {mode: [] for mode in modes}
            errors: List[str] = []
            for repeat in range(args.repeats):
                for mode in modes if repeat % 2 == 0 else modes[::-1]:
                    result = run_once(directory, mode, procs, chunks, args.timeout)
                    runs[mode].append(result["seconds"])
                    errors += result["errors"]
            medians = {mode: statistics.median(s) if s and None not in s else None for mode, s in runs.items()}
            own = medians[OWN_FILES]
            ratios = {
                mode: medians[mode] / own if medians.get(mode) is not None and own is not None else None
                for mode in SHARED_MODES
            }
            rows.append({"procs": procs, "seconds": runs, "medians": medians, "ratios": ratios, "errors": errors})
            print(_row(rows[-1]), flush=True)
    finally:
        for path in directory.glob("*.bin"):
            path.unlink()
        directory.rmdir()
    return {
        "dir": str(args.dir), "filesystem": filesystem_of(args.dir), "mb_per_process": args.mb, "modes": list(MODES),
        "refused": refused, "rows": rows,
    }


def _row(row: Dict[str, Any]) -> str:
    def cell(mode: str) -> str:
        if mode not in row["medians"]:
            return "refused"
        value = row["medians"][mode]
        if value is None:
            return "failed"
        ratio = row["ratios"].get(mode)
        return f"{value:.3f}" + ("" if ratio is None else f" ({ratio:.2f}x)")

    return f"{row['procs']:>5} " + " ".join(f"{cell(mode):>20}" for mode in MODES) + (
        f"   {len(row['errors'])} error(s): {row['errors'][0]}" if row["errors"] else ""
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mb < 8 or args.mb % 8 or args.repeats < 1 or args.timeout <= 0:
        parser.error("--mb must be a positive multiple of 8, --repeats at least 1 and --timeout positive")
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    print(f"{args.mb} MiB per process in {CHUNK // MIB} MiB pwrite calls, then fdatasync; {args.dir} "
          f"({filesystem_of(args.dir)}); median of {args.repeats} runs, slowest process, seconds (x own files)")
    print(f"{'procs':>5} " + " ".join(f"{mode:>20}" for mode in MODES), flush=True)
    result = measure(args)
    for mode, reason in result["refused"].items():
        print(f"{mode}: {reason}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 1 if any(row["errors"] for row in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
