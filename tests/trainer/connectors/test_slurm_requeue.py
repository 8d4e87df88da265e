"""Slurm's ``SIGUSR1`` (``SLURMEnvironment(auto_requeue=True)``): the job is requeued once per signal, only after
every task saved the HPC checkpoint and it is committed, and the requeued job resumes from it."""
import hashlib
import json
import os
import random
import signal

import pytest

from fsdp_harness.multiprocess import assert_success, run_tasks
from fsdp_harness.scenario import read_results
from pytorch_lightning import Trainer
from pytorch_lightning.plugins.environments import SLURMEnvironment
from tests.helpers.boring_model import BoringModel
from tests.helpers.fake_slurm import install_fake_scontrol, slurm_task_envs
from tests.helpers.runif import RunIf
from tests.trainer.connectors.slurm_requeue_scenarios import BATCHES, SIGNALLED_BATCH, VAL_CHECK_INTERVAL

SCENARIOS = "tests.trainer.connectors.slurm_requeue_scenarios"
#: how many batch boundaries after the first one following the signal each case saves at
LATER = {"fsdp-stream": 0, "fsdp-async": 0, "ddp": 1}


def _check_requeue(record, job_id, newest, global_step, sha):
    """One call of the fake ``scontrol``: ``scontrol requeue <job id>``, when ``newest`` was the newest HPC checkpoint
    on disk, complete (it loads, with the model and optimizer states) and committed (no temporary file beside it)."""
    assert record["argv"] == ["requeue", job_id], record
    assert record.get("newest") == newest, f"scontrol ran when the newest HPC checkpoint was not {newest}: {record}"
    assert record["loads"] and record["global_step"] == global_step, record
    assert record["state_dict"] > 0 and record["optimizer_states"] == 1, record
    assert not [name for name in record["files"] if name.endswith(".tmp")], record
    assert record["sha256"] == sha, "the checkpoint changed after scontrol ran"


@RunIf(skip_windows=True)
@pytest.mark.timeout(420)
def test_sigusr1_requeues_after_the_checkpoint_is_committed(tmp_path):
    """Both tasks of a Slurm job step get ``SIGUSR1`` in the middle of a backward pass (FSDP synchronous streamed
    save, FSDP ``async_checkpoint=True`` with slow writes, DDP) or of a validation run (DDP): no error, exactly one
    ``scontrol requeue`` per signal, the HPC checkpoint complete and committed when it runs, saved at the next
    training batch boundary (after the validation run), and a fit started again in the folder resumes from it. A save
    that fails (``ENOSPC`` on rank 0) still requeues, with the previous checkpoint intact and an error logged."""
    job_id = str(random.randint(100000, 999999))
    install_fake_scontrol(tmp_path / "bin")
    envs = slurm_task_envs(2, int(job_id), tmp_path / "bin")
    result = run_tasks(SCENARIOS, ["cases", "--out", str(tmp_path / "out")], envs, timeout=360)
    assert_success(result)
    results = read_results(tmp_path / "out", 2)
    zero = results[0]
    for case in ("fsdp-stream", "fsdp-async", "ddp"):
        # over the gloo checkpoint group (FSDP) the ranks agree at the next boundary; over the default group (DDP)
        # one boundary later, so that the check synchronises no device
        step = SIGNALLED_BATCH + 1 + LATER[case]
        first, second = zero[case]["fits"]
        requeues = zero[case]["scontrol"]
        # the handler ran inside the backward pass on both tasks (FSDP: in FairScale's backward hooks)
        for rank, task in enumerate(results):
            received = task[case]["fits"][0]["received"]
            assert len(received) == 1, (case, rank, received)
            assert "_engine_run_backward" in received[0]["stack"], (case, rank, received)
            if case.startswith("fsdp"):
                assert received[0]["fsdp_state"] != "TrainingState.IDLE", (case, rank, received)
        _check_requeue(requeues[0], job_id, "hpc_ckpt_1.ckpt", step, first["sha256"]["hpc_ckpt_1.ckpt"])
        assert first["end_step"] == BATCHES, first  # training went on after the requeue
        # the job started again resumes from the checkpoint
        for task in results:
            assert task[case]["fits"][1]["start_step"] == step, (case, task[case]["fits"][1])
            assert task[case]["fits"][1]["end_step"] == 2 * BATCHES, (case, task[case]["fits"][1])
        assert second["restore_mismatches"] == [] and second["restored_keys"] > 0, second
    assert len(zero["fsdp-async"]["scontrol"]) == 1

    # the save of the second signal failed: requeued all the same, the previous checkpoint intact and newest
    stream = zero["fsdp-stream"]
    assert len(stream["scontrol"]) == 2, stream["scontrol"]
    first_sha = stream["fits"][0]["sha256"]["hpc_ckpt_1.ckpt"]
    _check_requeue(stream["scontrol"][1], job_id, "hpc_ckpt_1.ckpt", SIGNALLED_BATCH + 1, first_sha)
    assert stream["fits"][1]["sha256"] == {"hpc_ckpt_1.ckpt": first_sha}, stream["fits"][1]
    assert "Saving the HPC checkpoint for Slurm's SIGUSR1 failed" in result.output
    assert "[Errno 28]" in result.output

    # signalled during a validation run: saved once it ended, at the step it ran at
    ddp = zero["ddp"]
    assert len(ddp["scontrol"]) == 2, ddp["scontrol"]
    for rank, task in enumerate(results):
        received = task["ddp"]["fits"][1]["received"]
        assert len(received) == 1 and "_run_validation" in received[0]["stack"], (rank, received)
    ends = [task["ddp"]["fits"][1]["validation_ends"][0] for task in results]
    assert ends[0]["step"] == ends[1]["step"], ends
    # not at the boundary right after the validation run, where a checkpoint would resume into that run again, but
    # at one after a training batch without validation (every second batch runs it here: an odd step)
    saved_at = ddp["scontrol"][1]["global_step"]
    assert saved_at > ends[0]["step"] and saved_at % VAL_CHECK_INTERVAL, (saved_at, ends)
    _check_requeue(ddp["scontrol"][1], job_id, "hpc_ckpt_2.ckpt", saved_at, ddp["fits"][1]["sha256"]["hpc_ckpt_2.ckpt"])
    assert ddp["scontrol"][1]["time"] > max(end["time"] for end in ends), (ddp["scontrol"][1], ends)


@RunIf(skip_windows=True)
@pytest.mark.timeout(120)
def test_sigusr1_single_process_saves_at_the_batch_boundary(tmp_path, monkeypatch):
    """One task (no agreement between ranks): ``SIGUSR1`` in the middle of ``training_step`` saves the checkpoint at
    the end of that batch, and ``scontrol requeue`` runs once, with the file complete."""
    job_id = "4242"
    install_fake_scontrol(tmp_path / "bin")
    for name, value in slurm_task_envs(1, int(job_id), tmp_path / "bin")[0].items():
        if name.startswith("SLURM_") or name == "PATH":
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("FAKE_SCONTROL_DIR", str(tmp_path))

    class SignalledModel(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == SIGNALLED_BATCH:
                os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler right here
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert isinstance(trainer._accelerator_connector.cluster_environment, SLURMEnvironment)
    trainer.fit(SignalledModel())
    records = [json.loads(line) for line in (tmp_path / "scontrol.jsonl").read_text().splitlines()]
    assert len(records) == 1, records
    sha = hashlib.sha256((tmp_path / "hpc_ckpt_1.ckpt").read_bytes()).hexdigest()
    _check_requeue(records[0], job_id, "hpc_ckpt_1.ckpt", SIGNALLED_BATCH + 1, sha)
    assert trainer.global_step == 4
