"""Whether every rank can write the one checkpoint file (``DDPFullyShardedStrategy(checkpoint_writers=...)``,
``pytorch_lightning/strategies/fsdp_writer_decision.py``):

- on 2 CPU FSDP ranks over gloo (``tests/strategies/fsdp_writer_decision_scenarios.py``, one launch for every case):
  a directory both ranks share; node-local scratch, emulated by a mount namespace of global rank 1's own with another
  directory bind-mounted over the checkpoint directory (root only); a FUSE object-store mount in global rank 1's mount
  table (a fake ``/proc``);
- in this process: the FUSE rule on fake mount tables, ``"rank0"`` and a single process probe nothing, and a probe
  file whose writer died is removed by the stale-temporary-file rule.
"""
import os
from types import SimpleNamespace
from unittest import mock

import psutil
import pytest
import torch
from torch import nn

from fsdp_harness.runner import ScenarioBatch, selected_tests
from pytorch_lightning.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies import DDPFullyShardedStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from pytorch_lightning.strategies.fsdp_writer_decision import (
    _setup_refusal,
    _decide_checkpoint_writers,
    _mount_refusal,
    _write_probe,
    CONCURRENT_WRITERS_REFUSED_FSTYPES,
)
from pytorch_lightning.utilities.atomic_save import _TEMPORARY_FILE_NAME, remove_stale_temporary_files
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from tests.helpers.fake_proc import FakeProc
from tests.helpers.mount_namespace import mount_namespace_unavailable

SCENARIOS = "tests.strategies.fsdp_writer_decision_scenarios"
BATCH_TIMEOUT = 300
NO_MOUNT_NAMESPACE = mount_namespace_unavailable()
ALL = [{"writers": "all", "reason": None}]


@pytest.fixture(scope="module")
def decisions(tmp_path_factory, request):
    """Every case of the module's selected tests, in one launch of 2 ranks; the folders they use."""
    root = tmp_path_factory.mktemp("writer_decision").resolve()
    dirs = SimpleNamespace(shared=root / "shared", scratch=root / "scratch", node1=root / "scratch-node1")
    for folder in vars(dirs).values():
        folder.mkdir()
    fake = FakeProc(root / "fake")
    # global rank 1's mount table: the shared directory is a gcsfuse mount
    fake.set_mounts([("/", "ext4"), (dirs.shared, "fuse.gcsfuse")])
    batch = ScenarioBatch(SCENARIOS, root / "out", timeout=BATCH_TIMEOUT)
    selected = selected_tests(request)
    for requested in ("auto", "all"):
        if "test_one_directory_every_rank_sees" in selected:
            batch.add(f"shared-{requested}", "decide", "--dir", dirs.shared, "--requested", requested)
        if "test_node_local_scratch" in selected and NO_MOUNT_NAMESPACE is None:
            node_local = ("--dir", dirs.scratch, "--node-local", dirs.node1, "--requested", requested)
            batch.add(f"node-local-{requested}", "decide", *node_local, *(["--twice"] if requested == "auto" else []))
        if "test_object_store_fuse_mount_on_one_rank" in selected:
            fuse = ("--dir", dirs.shared, "--fake-mounts", fake.proc, "--requested", requested)
            batch.add(f"fuse-{requested}", "decide", *fuse)
    return batch, dirs


def _check_fallback(results, reason):
    """``"auto"`` falls back on every rank with ``reason``, which global rank 0 says once, and no file is left."""
    for result in results:
        assert all(d == {"writers": "rank0", "reason": reason} for d in result["decisions"]), result
        assert result["left"] == [], result
    assert len(results[0]["info"]) == 1, results[0]
    assert "global rank 0 writes the checkpoint alone" in results[0]["info"][0] and reason in results[0]["info"][0]
    assert results[1]["info"] == []


def _check_raised(results, *words):
    """``"all"`` raises ``MisconfigurationException`` on every rank, with the same message naming ``words``."""
    for result in results:
        (decision,) = result["decisions"]
        assert decision["raised"] == "MisconfigurationException", result
        assert "checkpoint_writers='all'" in decision["message"] and all(w in decision["message"] for w in words)
        assert decision["message"] == results[0]["decisions"][0]["message"]
        assert result["left"] == [], result


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_one_directory_every_rank_sees(decisions):
    batch, dirs = decisions
    for requested in ("auto", "all"):
        for result in batch.results(f"shared-{requested}"):
            assert result["decisions"] == ALL and result["info"] == [] and result["left"] == [], result
    assert os.listdir(dirs.shared) == []


@pytest.mark.skipif(NO_MOUNT_NAMESPACE is not None, reason=str(NO_MOUNT_NAMESPACE))
@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_node_local_scratch(decisions):
    """Global rank 1 sees another directory at the checkpoint directory, as on another node with its own scratch:
    ``"auto"`` falls back to global rank 0 alone, saying so once for two saves; ``"all"`` raises on every rank."""
    batch, dirs = decisions
    reason = f"rank 1 cannot see the file written by rank 0 at {dirs.scratch}"
    _check_fallback(batch.results("node-local-auto"), reason)
    _check_raised(batch.results("node-local-all"), reason)
    # the probe files went, from rank 0's directory, and none was written into rank 1's
    assert os.listdir(dirs.scratch) == [] and os.listdir(dirs.node1) == []


@pytest.mark.timeout(BATCH_TIMEOUT + 60)
def test_object_store_fuse_mount_on_one_rank(decisions):
    """Global rank 1's mount table has the directory on gcsfuse: rank 1's cause reaches every rank."""
    batch, dirs = decisions
    reason = (
        f"on rank 1, the checkpoint directory {dirs.shared} is on a gcsfuse mount ({dirs.shared}), which does not"
        " allow concurrent writers"
    )
    _check_fallback(batch.results("fuse-auto"), reason)
    _check_raised(batch.results("fuse-all"), reason)


@pytest.fixture
def fake_mounts(tmp_path, monkeypatch):
    fake = FakeProc(tmp_path / "fake")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(fake.proc))
    return fake


@pytest.mark.parametrize("fstype", CONCURRENT_WRITERS_REFUSED_FSTYPES)
def test_object_store_fuse_mounts_refuse_concurrent_writers(tmp_path, fake_mounts, fstype):
    bucket = tmp_path.resolve() / "bucket"
    inside = bucket / "run" / "checkpoints"
    inside.mkdir(parents=True)
    fake_mounts.set_mounts([("/", "ext4"), (bucket, fstype)])
    kind = fstype.split(".", 1)[1]
    expected = f"on {{ranks}}, the checkpoint directory {inside} is on a {kind} mount ({bucket}), which does not"
    assert _mount_refusal(str(inside)) == expected + " allow concurrent writers"


@pytest.mark.parametrize("fstype", ["fuse.sshfs", "fuse.some-new-object-store"])
def test_unknown_fuse_mounts_are_not_trusted_with_concurrent_writers(tmp_path, fake_mounts, fstype):
    """A FUSE filesystem may be an object store that uploads each host's copy whole: only the known ones that write
    through to a shared POSIX filesystem take several writers."""
    mnt = tmp_path.resolve() / "mnt"
    mnt.mkdir()
    fake_mounts.set_mounts([("/", "ext4"), (mnt, fstype)])
    kind = fstype.split(".", 1)[1]
    expected = f"on {{ranks}}, the checkpoint directory {mnt} is on a {kind} mount ({mnt}), which is not known to"
    assert _mount_refusal(str(mnt)) == expected + " allow concurrent writers"


@pytest.mark.parametrize(
    "fstype", ["ext4", "xfs", "nfs4", "lustre", "gpfs", "fuse.fuse-overlayfs", "fuseblk", "fuse.glusterfs"]
)
def test_shared_and_local_filesystems_take_concurrent_writers(tmp_path, fake_mounts, fstype):
    mnt = tmp_path.resolve() / "mnt"
    mnt.mkdir()
    fake_mounts.set_mounts([("/", "ext4"), (mnt, fstype)])
    assert _mount_refusal(str(mnt)) is None


def test_the_mount_of_the_directory_decides(tmp_path, fake_mounts):
    """The longest mount point that holds the directory, after its symlinks: an NFS mount inside a gcsfuse bucket
    takes concurrent writers, a symlink into the bucket does not."""
    root = tmp_path.resolve()
    bucket, nfs = root / "bucket", root / "bucket" / "nfs"
    nfs.mkdir(parents=True)
    (root / "link").symlink_to(bucket)
    fake_mounts.set_mounts([("/", "ext4"), (bucket, "fuse.gcsfuse"), (nfs, "nfs4")])
    assert _mount_refusal(str(nfs)) is None
    assert "gcsfuse" in _mount_refusal(str(root / "link"))
    # an unreadable mount table refuses nothing
    os.remove(fake_mounts.proc / "self" / "mounts")
    assert _mount_refusal(str(bucket)) is None


def test_rank0_and_a_single_process_probe_nothing(tmp_path):
    """No probe file and no collective: the directory does not even exist, and no process group does."""
    missing = str(tmp_path / "missing" / "last.ckpt.tmp")
    two = SimpleNamespace(global_rank=0, world_size=2)
    assert _decide_checkpoint_writers(two, missing, "rank0") == ("rank0", None)
    one = SimpleNamespace(global_rank=0, world_size=1)
    for requested in ("auto", "all"):
        assert _decide_checkpoint_writers(one, missing, requested) == ("all", None)
    with pytest.raises(MisconfigurationException, match="must be one of 'auto', 'all', 'rank0', got 'every'"):
        _decide_checkpoint_writers(two, missing, "every")
    with pytest.raises(MisconfigurationException, match="must be one of 'auto', 'all', 'rank0', got True"):
        DDPFullyShardedStrategy(checkpoint_writers=True)
    # the default since issue 29 (point 3); one process with it writes as "rank0" (see the parallel-save tests)
    assert DDPFullyShardedStrategy().checkpoint_writers == "auto"


def test_probe_file_of_a_killed_writer_is_removed(tmp_path):
    """A probe file is named like a temporary checkpoint file: kept while its writer lives, removed by the next save
    or load into the directory once the writer is gone (here a child process that exits without removing it)."""
    own = _write_probe(str(tmp_path), "token")
    assert _TEMPORARY_FILE_NAME.match(os.path.basename(own))
    pid = os.fork()
    if pid == 0:
        try:
            _write_probe(str(tmp_path), "token")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    left = sorted(str(path) for path in tmp_path.iterdir())
    assert len(left) == 2
    assert remove_stale_temporary_files(str(tmp_path)) == [p for p in left if p != own]
    assert [str(path) for path in tmp_path.iterdir()] == [own]


def _strategy_of_two_ranks(device: str) -> DDPFullyShardedStrategy:
    environment = LightningEnvironment()
    environment.set_world_size(2)
    environment.set_global_rank(0)
    return DDPFullyShardedStrategy(cluster_environment=environment, parallel_devices=[torch.device(device)] * 2)


@pytest.fixture
def one_process_group(tmp_path):
    """A real gloo process group of this process alone, for a real FairScale FSDP instance."""
    rank = rank_zero_only.rank
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
    rank_zero_only.rank = rank


def test_setups_that_rule_out_every_rank_writing(one_process_group):
    """Each rank's pieces are placed by its global rank, so FSDP must shard over every rank; and the bytes at block
    edges need the gloo checkpoint group on GPUs. Both are known on every rank alike: no probe is needed."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    cpu, gpu = _strategy_of_two_ranks("cpu"), _strategy_of_two_ranks("cuda")
    assert _setup_refusal(cpu) is None  # no model yet, on CPU ranks
    # the job was set up without the gloo group (PL_CHECKPOINT_GLOO_GROUP=0): on GPUs the exchange would use NCCL
    assert _setup_refusal(gpu) == (
        "the job has no gloo checkpoint group (`PL_CHECKPOINT_GLOO_GROUP=0`) to exchange the bytes at block edges"
    )
    # FSDP sharding within a group of 1 of the job's 2 ranks (as within a node)
    module = nn.Sequential(FullyShardedDataParallel(nn.Linear(4, 4)))
    with mock.patch.object(DDPFullyShardedStrategy, "lightning_module", module):
        assert _setup_refusal(cpu) == "FSDP shards over a process group of 1 of the 2 ranks"
        with pytest.raises(MisconfigurationException, match="but FSDP shards over a process group of 1 of the 2"):
            _decide_checkpoint_writers(cpu, "unused/last.ckpt.tmp", "all")
