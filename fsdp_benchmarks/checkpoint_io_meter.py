"""Per-process instrumentation of the checkpoint's file I/O in a benchmark rank: bytes written, bytes read, and an
emulated per-writer bandwidth. Benchmark harness only, never the library.

Why instrumentation and not the OS's counters: ``/proc/self/io``'s ``write_bytes`` counts a page once, when it turns
dirty, so a rank that ``pwrite``s into pages another rank's skeleton dirtied counts nothing, and on tmpfs nothing at
all; ``wchar`` also counts gloo's socket writes. The ranks of one host share a page cache, so reads cannot be split
between them by the OS either.

:func:`install` wraps, in this process, every way the fork and torch DCP reach a checkpoint file:

- ``io.open`` / ``builtins.open`` (which ``os.fdopen``, ``pathlib.Path.open`` and fsspec's local files go through)
  in binary mode: the file gets a :class:`_MeteredFileIO` raw layer under the usual buffer, so the bytes counted are
  those each ``write``/``readinto`` system call moved (torch.save of the skeleton or a gathered save, DCP's files);
- ``os.pwrite`` / ``os.write`` (the fork's streamed writer ``pwrite``s the tensors into its temporary file);
- ``os.fsync`` / ``os.fdatasync`` on such files.

Besides the bytes it sums the seconds this process spent in those writes and syncs (``io_seconds``, over all its
threads), so that a save's time outside them can be told apart, and the seconds spent computing the CRC-32s of the
checkpoint's records (``crc_seconds``: the fork's ``checkpoint_crc._crc32``, which saves and the load's check call).

Only files inside the checkpoint directory count (by path, or for a descriptor by ``/proc/self/fd``). With a rate,
every counted write then waits until a per-process link of that many MB/s (10^6 bytes) would have carried it:
writes of several threads of one rank queue on the same link, as if each rank were a node with its own link to
shared storage. Memory-mapped reads (the fork's resume) are not seen here; the fork's resume is counted by
:mod:`fsdp_harness.checkpoint_reads` instead.
"""
import builtins
import io
import os
import threading
import time
from typing import Any, Dict, Optional


class _Link:
    """A link of ``rate`` bytes/s shared by the threads of this process: each transfer waits for the ones before."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0
        self._lock = threading.Lock()

    def transfer(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - now))


class CheckpointIOMeter:
    """Counts this process's bytes written to and read from files under ``directory``; throttles the writes to
    ``write_mbps`` MB/s when given."""

    def __init__(self, directory: str, write_mbps: Optional[float] = None) -> None:
        self.directory = os.path.join(os.path.realpath(directory), "")
        self.link = _Link(write_mbps * 1e6) if write_mbps else None
        self.write_mbps = write_mbps
        self.bytes_written = 0
        self.bytes_read = 0
        self.io_seconds = 0.0
        self.crc_seconds = 0.0
        self._lock = threading.Lock()

    def covers(self, file: Any) -> bool:
        if isinstance(file, int):
            try:
                file = os.readlink(f"/proc/self/fd/{file}")
            except OSError:
                return False
        elif not isinstance(file, (str, bytes, os.PathLike)):
            return False
        return os.path.realpath(os.fsdecode(file)).startswith(self.directory)

    def wrote(self, nbytes: Optional[int], seconds: float = 0.0) -> None:
        """Count ``nbytes`` written in ``seconds``, and the wait for the emulated link (if any) as I/O time too."""
        start = time.perf_counter()
        if nbytes:
            with self._lock:
                self.bytes_written += nbytes
            if self.link is not None:
                self.link.transfer(nbytes)
        self.spent(seconds + time.perf_counter() - start)

    def spent(self, seconds: float) -> None:
        with self._lock:
            self.io_seconds += seconds

    def read(self, nbytes: Optional[int]) -> None:
        if nbytes:
            with self._lock:
                self.bytes_read += nbytes

    def since(self, before: Dict[str, Any]) -> Dict[str, Any]:
        """The bytes written and the seconds of I/O since ``before`` (a :meth:`snapshot`)."""
        now = self.snapshot()
        return {key: now[key] - before[key] for key in ("bytes_written", "io_seconds", "crc_seconds")}

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "bytes_written": self.bytes_written,
                "bytes_read": self.bytes_read,
                "io_seconds": self.io_seconds,
                "crc_seconds": self.crc_seconds,
            }


_meter: Optional[CheckpointIOMeter] = None


class _MeteredFileIO(io.FileIO):
    def write(self, b: Any) -> Optional[int]:
        start = time.perf_counter()
        written = super().write(b)
        _meter.wrote(written, time.perf_counter() - start)
        return written

    def readinto(self, b: Any) -> Optional[int]:
        count = super().readinto(b)
        _meter.read(count)
        return count

    def readall(self) -> bytes:
        data = super().readall()
        _meter.read(len(data))
        return data


def _metered_open(original: Any) -> Any:
    def open(file: Any, mode: str = "r", buffering: int = -1, encoding: Any = None, errors: Any = None,
             newline: Any = None, closefd: bool = True, opener: Any = None) -> Any:
        if "b" not in mode or not _meter.covers(file):
            return original(file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = _MeteredFileIO(file, mode.replace("b", "").replace("t", ""), closefd=closefd, opener=opener)
        if buffering == 0:
            return raw
        size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
        if raw.readable() and raw.writable():
            return io.BufferedRandom(raw, size)
        return io.BufferedWriter(raw, size) if raw.writable() else io.BufferedReader(raw, size)

    return open


def _metered_write(original: Any) -> Any:
    def write(fd: int, data: Any, *args: Any) -> int:
        start = time.perf_counter()
        written = original(fd, data, *args)
        seconds = time.perf_counter() - start  # before the check below, which is the meter's own cost
        if _meter.covers(fd):
            _meter.wrote(written, seconds)
        return written

    return write


def _metered_sync(original: Any) -> Any:
    def sync(fd: Any) -> None:
        start = time.perf_counter()
        original(fd)
        seconds = time.perf_counter() - start
        if _meter.covers(fd if isinstance(fd, int) else fd.fileno()):
            _meter.spent(seconds)

    return sync


def install(directory: str, write_mbps: Optional[float] = None) -> CheckpointIOMeter:
    """Meter (and with ``write_mbps`` throttle) this process's I/O to files under ``directory``, from now on. Called
    again (the next scenario of a batch), it starts a new meter for the new directory; the wrappers stay."""
    global _meter
    wrapped = _meter is not None
    _meter = CheckpointIOMeter(directory, write_mbps)
    if not wrapped:
        io.open = builtins.open = _metered_open(io.open)
        os.pwrite = _metered_write(os.pwrite)
        os.write = _metered_write(os.write)
        os.fsync = _metered_sync(os.fsync)
        os.fdatasync = _metered_sync(os.fdatasync)
        _time_crcs()
    return _meter


def crc_seconds() -> float:
    """The seconds this process spent in the CRC-32s of checkpoint records so far (0 without a meter)."""
    return _meter.crc_seconds if _meter is not None else 0.0


def _time_crcs() -> None:
    """Sum the time of every CRC-32 the fork computes over checkpoint records into the meter's ``crc_seconds``;
    nothing on a build without them (the ``compat`` build)."""
    try:
        from pytorch_lightning.utilities import checkpoint_crc, checkpoint_verification
    except ImportError:
        return
    original = checkpoint_crc._crc32

    def timed(data: Any, value: int = 0) -> int:
        start = time.perf_counter()
        try:
            return original(data, value)
        finally:
            if _meter is not None:
                with _meter._lock:
                    _meter.crc_seconds += time.perf_counter() - start

    checkpoint_crc._crc32 = checkpoint_verification._crc32 = timed
