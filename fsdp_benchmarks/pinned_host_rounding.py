"""Measure what torch's pinned host allocator takes for buffers of odd sizes and compare it with what the fork predicts
for the host copies of asynchronous checkpoints (``pytorch_lightning.utilities.host_memory.pinned_host_bytes``, a
block rounded up to a power of two): ``python -m fsdp_benchmarks.pinned_host_rounding``. Run by ``tools/gpu_check.sh``.

Each buffer is allocated as ``_HostCopies`` allocates a pinned host copy (``torch.empty(..., pin_memory=True)``) and
kept, so that no cached block is reused; the growth of ``torch.cuda.host_memory_stats()["allocated_bytes.current"]``
(the rounded blocks the allocator owns) must equal the prediction. A line ``FAILED ...`` names each mismatch; the exit
status is 1 if any. Without CUDA or that statistic (older torch) it says so and exits 0.
"""
import sys
from typing import List

import torch

from pytorch_lightning.utilities.host_memory import format_bytes, pinned_host_bytes

#: element counts of float32 buffers, odd on purpose: just above and below powers of two, and shard-like sizes
NUMELS = [1, 3, 1025, 262_143, 262_145, 3 * 2**20 + 7, 5_000_011, 2**24 + 1]
STAT = "allocated_bytes.current"


def main() -> int:
    if not torch.cuda.is_available():
        print("pinned_host_rounding: skipped, no CUDA device")
        return 0
    if not hasattr(torch.cuda, "host_memory_stats"):
        print(f"pinned_host_rounding: skipped, torch {torch.__version__} has no torch.cuda.host_memory_stats")
        return 0
    torch.cuda.init()
    if STAT not in torch.cuda.host_memory_stats():
        print(f"pinned_host_rounding: skipped, torch {torch.__version__}'s host_memory_stats has no {STAT!r}")
        return 0
    kept: List[torch.Tensor] = []
    failures = 0
    for numel in NUMELS:
        before = torch.cuda.host_memory_stats()[STAT]
        kept.append(torch.empty(numel, dtype=torch.float32, pin_memory=True))
        taken = torch.cuda.host_memory_stats()[STAT] - before
        nbytes = numel * 4
        predicted = pinned_host_bytes(nbytes)
        line = f"{nbytes} bytes: pinned allocator took {taken} ({format_bytes(taken)}), predicted {predicted}"
        if taken != predicted:
            failures += 1
            line = f"FAILED {line}"
        print(line)
    print(f"pinned_host_rounding: {len(NUMELS) - failures}/{len(NUMELS)} as predicted (torch {torch.__version__})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
