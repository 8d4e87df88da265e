"""Shared-file write benchmark: ``python -m fsdp_benchmarks.shared_file_writes --dir DIR [--procs 1,2,4] [--mb 128]
[--repeats 3] [--json OUT]`` (or ``python fsdp_benchmarks/shared_file_writes.py ...``).

Does the filesystem at ``DIR`` let several processes of one host write their own byte ranges of ONE file at once, as
the parallel save (``checkpoint_writers="all"``) does, or does it run them one after the other? Linux's buffered
write path takes the file's inode lock for each ``write``/``pwrite`` on most local filesystems (ext4, XFS, tmpfs) and
on NFS clients, so the ranks of one node copy their bytes into one file one at a time; other clients (Lustre, GPFS)
lock differently, which this measures. Separate files (one per rank, as torch DCP writes) do not share that lock.

For each number of processes P, P processes start together (a barrier) and each writes ``--mb`` MiB in 8 MiB
``pwrite`` calls, then ``fdatasync``-s: once into its own range of one file ("one file"), once into a file of its
own ("own files"), the two alternating ``--repeats`` times. Reported: the median over the repeats of the slowest
process's seconds for each, and their ratio (one file / own files: about 1 where the writes run in parallel, up to P
where they are serialized). Every byte of every file is read back and checked; the exit code is non-zero when one
is wrong or a process fails. Nothing here imports Lightning: it measures the filesystem alone.
"""
import argparse
import json
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
MODES = ("one file", "own files")


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
    return directory / ("shared.bin" if mode == "one file" else f"own-{process}.bin")


def _offset(mode: str, process: int, chunks: int) -> int:
    return process * chunks * CHUNK if mode == "one file" else 0


def _write(directory: Path, mode: str, process: int, chunks: int, start: Any, results: Any) -> None:
    """One process: its chunks into its range of the file of ``mode``, timed from the barrier to ``fdatasync``."""
    buffer = bytearray([process % 251 + 1]) * CHUNK
    fd = os.open(_path(directory, mode, process), os.O_WRONLY | os.O_CREAT, 0o644)
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
    if mode == "one file":
        _path(directory, mode, 0).touch()
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
        for procs in args.procs:
            runs: Dict[str, List[Optional[float]]] = {mode: [] for mode in MODES}
            errors: List[str] = []
            for repeat in range(args.repeats):
                for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                    result = run_once(directory, mode, procs, chunks, args.timeout)
                    runs[mode].append(result["seconds"])
                    errors += result["errors"]
            medians = {
                mode: statistics.median(s) if s and None not in s else None for mode, s in runs.items()
            }
            ratio = medians["one file"] / medians["own files"] if None not in medians.values() else None
            rows.append({
                "procs": procs, "one_file_s": runs["one file"], "own_files_s": runs["own files"],
                "one_file_median_s": medians["one file"], "own_files_median_s": medians["own files"],
                "ratio": ratio, "errors": errors,
            })
            print(_row(rows[-1]), flush=True)
    finally:
        for path in directory.glob("*.bin"):
            path.unlink()
        directory.rmdir()
    return {"dir": str(args.dir), "filesystem": filesystem_of(args.dir), "mb_per_process": args.mb, "rows": rows}


def _row(row: Dict[str, Any]) -> str:
    def cell(value: Optional[float]) -> str:
        return "failed" if value is None else f"{value:.3f}"

    ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
    return (
        f"{row['procs']:>5} {cell(row['one_file_median_s']):>13} {cell(row['own_files_median_s']):>13} {ratio:>20}"
        + (f"   {len(row['errors'])} error(s): {row['errors'][0]}" if row["errors"] else "")
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mb < 8 or args.mb % 8 or args.repeats < 1 or args.timeout <= 0:
        parser.error("--mb must be a positive multiple of 8, --repeats at least 1 and --timeout positive")
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    print(f"{args.mb} MiB per process in {CHUNK // MIB} MiB pwrite calls, then fdatasync; {args.dir} "
          f"({filesystem_of(args.dir)}); median of {args.repeats} runs, slowest process, seconds")
    print(f"{'procs':>5} {'one file':>13} {'own files':>13} {'one file / own files':>20}", flush=True)
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 1 if any(row["errors"] for row in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
