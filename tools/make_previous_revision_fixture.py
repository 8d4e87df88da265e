"""Write ``tests/strategies/fixtures/fsdp_revision80_adam.ckpt``: a checkpoint of fork revision 80, the last one whose
FSDP files hold the consolidated optimizer state (``fsdp_roots``, ``fsdp_root_param_ids``), for
``test_ddp_fully_sharded_portable.py::test_previous_revision_file_resumes_with_its_optimizer_state``.

A real 2-rank FSDP run of that revision saves it (``fsdp_portable_scenarios.py``: Adam, 2 units of 4 x 4, a
parameter and a linear layer outside FSDP, one epoch). Next to it, ``fsdp_revision80_adam.state.pt`` holds the saving
run's own optimizer state by parameter name (its ranks' shards put together, independently of the file's layout),
which the test expects right after the load.

Run it from the root of a checkout of revision 80 (commit 22e27f6) with this script and the test's scenario module
copied in, after ``python -m fork_tools materialize``: ``python tools/make_previous_revision_fixture.py``. It refuses
to write a file of any other layout.
"""
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fsdp_harness.runner import run_scenario  # noqa: E402
from tests.strategies.test_ddp_fully_sharded_portable import (  # noqa: E402
    PREVIOUS_REVISION,
    PREVIOUS_REVISION_ARGS,
    SCENARIOS,
    named_state,
)


def main() -> None:
    revision = (ROOT / "patches" / "revision").read_text().split("revision = ")[1].split()[0]
    assert revision == "80", f"this is fork revision {revision}, not 80"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        run_scenario(SCENARIOS, "fit", out, "--strategy", "fsdp", *PREVIOUS_REVISION_ARGS, "--epochs", "1",
                     timeout=300)
        checkpoint = torch.load(out / "ckpts" / "epoch=0.ckpt", map_location="cpu", weights_only=True)
        assert "fsdp_roots" in checkpoint["optimizer_states"][0], sorted(checkpoint["optimizer_states"][0])
        ranks = [torch.load(out / f"rank{rank}.pt", map_location="cpu", weights_only=False) for rank in range(2)]
        PREVIOUS_REVISION.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "ckpts" / "epoch=0.ckpt", PREVIOUS_REVISION)
        torch.save(named_state([r["final"] for r in ranks]), PREVIOUS_REVISION.with_suffix(".state.pt"))
    print(f"wrote {PREVIOUS_REVISION} ({PREVIOUS_REVISION.stat().st_size} bytes) at fork revision {revision}")


if __name__ == "__main__":
    main()
