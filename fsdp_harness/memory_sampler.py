"""Peak memory of this process during a code block: host memory sampled by a thread at >= 200 Hz, and optionally
the CUDA allocator's own peak.

Two host figures, both from psutil's ``memory_info`` (on Linux ``/proc/<pid>/statm``):

- **anonymous** resident memory (Linux's ``RssAnon``, psutil's ``rss - shared``): it cannot be reclaimed without
  swap. This is what resuming is measured by.
- **anonymous plus mapped file pages** (``RssAnon + RssFile + RssShmem``, i.e. the whole ``rss``): file pages mapped
  into the process (an mmap-ed checkpoint, a mapped output file) count too. The save goal is stated in this one, so a
  save cannot look cheap by parking the state dict in a mapping. The file part alone (psutil's ``shared``, i.e.
  ``RssFile + RssShmem``) is reported too: on resume those pages are page cache of the one checkpoint file, shared
  by the ranks of a node and reclaimable, so they are shown beside the anonymous figure rather than added to it.

Where psutil reports no ``shared`` (not Linux), RSS stands in for anonymous memory and the file part reads 0.

glibc keeps freed blocks in its heap and silently reuses them, which makes "peak minus before" read too low and vary
from run to run. Two things make it stable: run the process with ``MALLOC_MMAP_THRESHOLD_=65536`` (large tensors are
mmap-ed and returned to the OS on free; the benchmark sets it for every rank) and call ``malloc_trim(0)`` before
reading the baseline (done here).

With ``cuda_device`` set, :class:`PeakMemory` also resets that device's peak statistics on start and reports
``torch.cuda.max_memory_allocated`` on stop: device memory, which the host sampler cannot see.
"""
import ctypes
import ctypes.util
import gc
import sys
import threading
import time
from typing import Any, Dict, NamedTuple, Optional

import psutil

MIB = 1024 * 1024


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def malloc_trim() -> None:
    """Return free heap memory to the OS (glibc only; a no-op elsewhere)."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


class Memory(NamedTuple):
    """Resident bytes of this process: ``anon`` (RssAnon) and ``file`` (RssFile + RssShmem); ``anon_file`` is their
    sum, the whole RSS."""

    anon: int
    file: int

    @property
    def anon_file(self) -> int:
        return self.anon + self.file


def read_memory() -> Memory:
    info = psutil.Process().memory_info()
    shared = getattr(info, "shared", None)
    return Memory(info.rss, 0) if shared is None else Memory(info.rss - shared, shared)


def memory_source() -> str:
    return "psutil-rss-minus-shared" if hasattr(psutil.Process().memory_info(), "shared") else "psutil-rss"


class PeakMemory:
    """Context manager: baseline (after ``malloc_trim``) on enter, peak from a sampling thread until exit.

    :meth:`stop` (called on exit) returns :meth:`result`, in MiB unless said otherwise: ``peak_extra_mb``
    (anonymous peak minus baseline), ``peak_extra_anon_file_mb`` (anonymous plus mapped file pages, peak minus
    baseline; the peak of the sum, not the sum of the peaks), ``peak_extra_file_mb`` (mapped file pages alone),
    ``baseline_anon_mb`` / ``baseline_file_mb``, ``seconds``, ``samples``, ``sample_hz``, and with ``cuda_device``
    ``cuda_max_allocated_mb``. :attr:`running` says whether it was started and not yet stopped.
    """

    def __init__(self, interval: float = 0.002, cuda_device: Any = None) -> None:
        self.interval = interval
        self.cuda_device = cuda_device
        self.cuda_max_allocated: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def _sample(self) -> None:
        now = read_memory()
        self.peak_anon = max(self.peak_anon, now.anon)
        self.peak_file = max(self.peak_file, now.file)
        self.peak_anon_file = max(self.peak_anon_file, now.anon_file)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def start(self) -> "PeakMemory":
        malloc_trim()
        if self.cuda_device is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(self.cuda_device)
        self.base = read_memory()
        self.peak_anon, self.peak_file, self.peak_anon_file = self.base.anon, self.base.file, self.base.anon_file
        self.samples = 0
        # The sampler needs the GIL for a moment every few ms, also while pickling holds it.
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, 0.001))
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> Dict[str, float]:
        self.seconds = time.perf_counter() - self._start
        self._stop.set()
        self._thread.join()
        self._sample()
        sys.setswitchinterval(self._switch)
        if self.cuda_device is not None:
            import torch

            self.cuda_max_allocated = torch.cuda.max_memory_allocated(self.cuda_device)
        return self.result()

    def result(self) -> Dict[str, float]:
        result = {
            "peak_extra_mb": (self.peak_anon - self.base.anon) / MIB,
            "peak_extra_anon_file_mb": (self.peak_anon_file - self.base.anon_file) / MIB,
            "peak_extra_file_mb": (self.peak_file - self.base.file) / MIB,
            "baseline_anon_mb": self.base.anon / MIB,
            "baseline_file_mb": self.base.file / MIB,
            "seconds": self.seconds,
            "samples": self.samples,
            "sample_hz": self.samples / self.seconds if self.seconds > 0 else 0.0,
        }
        if self.cuda_max_allocated is not None:
            result["cuda_max_allocated_mb"] = self.cuda_max_allocated / MIB
        return result

    def __enter__(self) -> "PeakMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
