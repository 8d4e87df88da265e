"""Peak host memory of this process during a code block, sampled by a thread at >= 200 Hz.

The figure that matters is anonymous resident memory (Linux's ``RssAnon``): it cannot be reclaimed without swap,
unlike clean file-backed pages such as an mmap-ed checkpoint. Plain RSS is reported beside it. Both come from psutil:
on Linux its ``shared`` is the file-backed and shared-memory part of RSS (``/proc/<pid>/statm``), so ``rss - shared``
is ``RssAnon``; where psutil reports no ``shared``, RSS stands in for both.

glibc keeps freed blocks in its heap and silently reuses them, which makes "peak minus before" read too low and vary
from run to run. Two things make it stable: run the process with ``MALLOC_MMAP_THRESHOLD_=65536`` (large tensors are
mmap-ed and returned to the OS on free; the benchmark sets it for every rank) and call ``malloc_trim(0)`` before
reading the baseline (done here).
"""
import ctypes
import ctypes.util
import gc
import sys
import threading
import time
from typing import Dict, Optional, Tuple

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


def read_memory() -> Tuple[int, int]:
    """``(anonymous resident bytes, resident bytes)`` of this process."""
    info = psutil.Process().memory_info()
    shared = getattr(info, "shared", None)
    return (info.rss if shared is None else info.rss - shared), info.rss


def memory_source() -> str:
    return "psutil-rss-minus-shared" if hasattr(psutil.Process().memory_info(), "shared") else "psutil-rss"


class PeakMemory:
    """Context manager: baseline (after ``malloc_trim``) on enter, peak from a sampling thread until exit.

    :meth:`stop` (called on exit) returns :meth:`result`: ``peak_extra_mb`` / ``peak_extra_rss_mb`` (anonymous /
    resident peak minus baseline, MiB), ``baseline_anon_mb`` / ``baseline_rss_mb``, ``seconds``, ``samples`` and
    ``sample_hz``. :attr:`running` says whether it was started and not yet stopped.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def _sample(self) -> None:
        anon, rss = read_memory()
        self.peak_anon = max(self.peak_anon, anon)
        self.peak_rss = max(self.peak_rss, rss)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def start(self) -> "PeakMemory":
        malloc_trim()
        self.base_anon, self.base_rss = read_memory()
        self.peak_anon, self.peak_rss, self.samples = self.base_anon, self.base_rss, 0
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
        return self.result()

    def result(self) -> Dict[str, float]:
        return {
            "peak_extra_mb": (self.peak_anon - self.base_anon) / MIB,
            "peak_extra_rss_mb": (self.peak_rss - self.base_rss) / MIB,
            "baseline_anon_mb": self.base_anon / MIB,
            "baseline_rss_mb": self.base_rss / MIB,
            "seconds": self.seconds,
            "samples": self.samples,
            "sample_hz": self.samples / self.seconds if self.seconds > 0 else 0.0,
        }

    def __enter__(self) -> "PeakMemory":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
