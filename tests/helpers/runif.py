"""``RunIf``: skip a test unless the machine has what it needs; same name and keywords as Lightning's tests."""
import os
import sys
from typing import Optional

import pytest
import torch

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE


class RunIf:
    """Build a ``pytest.mark.skipif`` from requirements.

    Example::

        @RunIf(min_gpus=2, skip_windows=True, standalone=True, fairscale_fully_sharded=True)
        def test_something(): ...

    Args:
        min_gpus: the number of CUDA devices the test needs.
        standalone: the test must run in its own process (multi-GPU DDP re-launches the test command);
            it only runs when ``PL_RUN_STANDALONE_TESTS=1``, as ``tests/standalone_tests.sh`` sets.
        fairscale_fully_sharded: needs FairScale's ``FullyShardedDataParallel``.
        skip_windows: skip on Windows.
    """

    def __new__(
        cls,
        *args,
        min_gpus: int = 0,
        standalone: bool = False,
        fairscale_fully_sharded: bool = False,
        skip_windows: bool = False,
        min_torch: Optional[str] = None,
        **kwargs,
    ):
        conditions = []
        reasons = []
        if min_gpus:
            conditions.append(torch.cuda.device_count() < min_gpus)
            reasons.append(f"GPUs>={min_gpus}")
        if standalone:
            conditions.append(os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1")
            reasons.append("Standalone execution")
            # tests/standalone_tests.sh and tests/conftest.py select tests by this marker
            kwargs["standalone"] = True
        if fairscale_fully_sharded:
            conditions.append(not _FAIRSCALE_FULLY_SHARDED_AVAILABLE)
            reasons.append("FairScale Fully Sharded Data Parallel")
        if skip_windows:
            conditions.append(sys.platform == "win32")
            reasons.append("unimplemented on Windows")
        if min_torch:
            from packaging.version import Version

            conditions.append(Version(torch.__version__.split("+")[0]) < Version(min_torch))
            reasons.append(f"torch>={min_torch}")
        reasons = [r for c, r in zip(conditions, reasons) if c]
        return pytest.mark.skipif(
            *args, condition=any(conditions), reason=f"Requires: [{' + '.join(reasons)}]", **kwargs
        )
