"""Test-session setup shared by the whole suite."""
import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "standalone: runs in its own process (see tests/standalone_tests.sh)")
    config.addinivalue_line("markers", "release: run before a release only, with PL_RUN_RELEASE_TESTS=1")
    if os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1":
        # Every test outside the standalone (GPU) run is a CPU test, and the multi-process ones run FairScale FSDP
        # through the CPU harness (fsdp_harness/cpu_fsdp.py), which is only correct without CUDA: with a GPU
        # visible FairScale picks `cuda` as compute device under a CPU/gloo strategy. Hide CUDA from this process
        # and every rank it starts, so that the suite behaves the same on a GPU machine (CI's GPU agents).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if os.getenv("PL_RUN_RELEASE_TESTS", "0") != "1":
        # Slow checks whose paths CI covers elsewhere (CONTRIBUTING.md, "Before a release"): skipped with the reason,
        # so that the log says how to run them.
        skip = pytest.mark.skip(reason="release check: set PL_RUN_RELEASE_TESTS=1 to run it")
        for item in items:
            if item.get_closest_marker("release"):
                item.add_marker(skip)
    # PL_RUN_STANDALONE_TESTS=1 selects only the tests marked standalone (RunIf(standalone=True)), as
    # tests/standalone_tests.sh runs them one process each; otherwise they are collected and skipped.
    if os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1":
        return
    selected = [item for item in items if any(m.kwargs.get("standalone") for m in item.iter_markers("skipif"))]
    deselected = [item for item in items if item not in selected]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = selected


@pytest.fixture(autouse=True)
def _restore_env():
    # Lightning's launchers export rank variables into os.environ; keep tests from leaking them into each other.
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
