"""Peak host memory of this process during a code block, sampled by a thread at >= 200 Hz.

The figure that matters is anonymous resident memory (``RssAnon`` in ``/proc/<pid>/status``): it cannot be reclaimed
without swap, unlike clean file-backed pages such as an mmap-ed checkpoint. Plain RSS (``VmRSS``) is reported beside
it. Without ``/proc`` both fall back to psutil's RSS.

glibc keeps freed blocks in its heap and silently reuses them, which makes "peak minus before" read too low and vary
from run to run. Two things make it stable: run the process with ``MALLOC_MMAP_THRESHOLD_=65536`` (large tensors are
mmap-ed and returned to the OS on free; the benchmark sets it for every rank) and call ``malloc_trim(0)`` before
reading the baseline (done here).
"""
import ctypes
import ctypes.util
import gc
import os
import sys
import threading
import time
from typing import Dict, Optional, Tuple

MIB = 1024 * 1024
_STATUS = f"/proc/{os.getpid()}/status"


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
    try:
        with open(f"/proc/{os.getpid()}/status", "rb") as f:
            text = f.read()
        anon = rss = None
        for line in text.splitlines():
            if line.startswith(b"RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith(b"VmRSS:"):
                rss = int(line.split()[1]) * 1024
        if anon is not None and rss is not None:
            return anon, rss
    except OSError:
        pass
    import psutil

    rss = psutil.Process().memory_info().rss
    return rss, rss


def memory_source() -> str:
    return "proc-status-RssAnon" if os.path.exists(_STATUS) else "psutil-rss"


class PeakMemory:
    """Context manager: baseline (after ``malloc_trim``) on enter, peak from a sampling thread until exit.

    After exit: ``extra_anon_mb`` / ``extra_rss_mb`` (peak minus baseline), ``seconds``, ``samples``, ``hz``.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

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
