"""``kill -9`` of a ``DDPFullyShardedStrategy`` job in the middle of a save, and the restarted job, on filesystems where
``flock`` fails (NFSv3 without a lock daemon, Lustre without ``flock``, NFS's byte-range emulation of it): the
restarted job resumes, the killed save's temporary file is removed when the checkpoint is loaded, and streamed and
gathered saves work on each of those filesystems, as Lightning 1.6.5's did.

Runs ``tests/strategies/fsdp_flock_scenarios.py`` on 2 CPU ranks (see fsdp_harness/cpu_fsdp.py). The cleanup and
both writers are also tested in one process, for each filesystem, in
``tests/checkpointing/test_stale_temporary_files.py``.
"""
import json

import pytest

from fsdp_harness.runner import launch, run_scenario
from pytorch_lightning.utilities.atomic_save import _writer_host_id
from tests.helpers import flock_faults

SCENARIOS = "tests.strategies.fsdp_flock_scenarios"


@pytest.mark.timeout(420)
def test_killed_mid_save_then_restarted_job(tmp_path):
    # the job runs where flock behaves as on NFS (an exclusive lock needs a descriptor open for writing)
    killed = launch(SCENARIOS, "killed_mid_save", tmp_path, "--flock", "nfs", timeout=180)
    assert not killed.timed_out, killed.output[-6000:]
    assert killed.returncode == -9, f"rank 0 was not killed:\n{killed.output[-6000:]}"
    facts = json.loads((tmp_path / "facts.json").read_text())
    ckpts = tmp_path / "ckpts"
    debris = sorted(p.name for p in ckpts.glob("*.tmp"))
    assert len(debris) == 1 and debris[0].startswith(f"last.ckpt.{_writer_host_id()}.{facts['pid']}."), debris
    assert (ckpts / "last.ckpt").read_bytes().hex()[:64] == facts["last"]  # the previous checkpoint is intact

    results = run_scenario(SCENARIOS, "restarted", tmp_path, "--flock", "nfs", timeout=240)
    rank0 = results[0]
    assert rank0["before_resume"] == debris
    assert rank0["at_resume"] == [], "loading the checkpoint did not remove the killed save's temporary file"
    assert all(r["global_step"] == 4 for r in results), results  # resumed after epoch 1 (2 steps), trained epoch 2
    for kind in flock_faults.KINDS:
        assert rank0[f"stream_reason-{kind}"] is None  # streamed
        assert rank0[f"differences-{kind}"] == []
        assert rank0[f"state_dict-{kind}"] > 0
    assert rank0["after"] == []
