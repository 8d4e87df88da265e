"""When the streamed checkpoint file is ``fsync``-ed: after every chunk on local filesystems, only before the rename
where an ``fsync`` uploads the file or waits on a server (FUSE mounts of object stores, NFS, Lustre), decided from a
fake mount table (``psutil.PROCFS_PATH`` pointed at a :class:`~tests.helpers.fake_proc.FakeProc`) or from
``PL_CHECKPOINT_CHUNK_FSYNC``."""
import os
import stat
import sys

import psutil
import pytest
import torch

from pytorch_lightning.utilities import checkpoint_flush
from pytorch_lightning.utilities.checkpoint_flush import (
    _chunk_fsync_policy,
    _fsync_waits_on_server,
    _Mount,
    _mount_of,
    CHUNK_FSYNC_ENV,
)
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile, _streamed_save_available
from tests.checkpointing.test_streamed_checkpoint_file import fake_tensors
from tests.helpers.fake_proc import FakeProc

REMOTE = ["fuse.gcsfuse", "fuse.s3fs", "fuse.blobfuse2", "fuse", "nfs", "nfs4", "lustre"]
LOCAL = ["ext4", "xfs", "tmpfs", "fuseblk", "overlay", "fuse.fuse-overlayfs"]


@pytest.fixture
def root(tmp_path):
    """``tmp_path`` resolved, so that the mount points are written as the kernel writes them."""
    return tmp_path.resolve()


@pytest.fixture
def fake_proc(root, monkeypatch):
    """A fake ``/proc`` whose mount table psutil reads (set it with ``fake_proc.set_mounts``); no log said yet and
    ``PL_CHECKPOINT_CHUNK_FSYNC`` unset."""
    fake = FakeProc(root / "fake")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(fake.proc))
    monkeypatch.setattr(checkpoint_flush, "_LOGGED", set())
    monkeypatch.delenv(CHUNK_FSYNC_ENV, raising=False)
    return fake


def folders(root, *names):
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    return [str(root / name) for name in names]


def test_the_longest_mount_point_that_contains_the_path_whole_components_compared(root, fake_proc):
    mnt, deep, ab, other = folders(root, "mnt", "mnt/a/deep", "mnt/ab", "other")
    # the longer mount point listed first: the match is the longest, not the last
    fake_proc.set_mounts([("/", "ext4"), (root / "mnt" / "a", "fuse.gcsfuse"), (mnt, "nfs4")])
    assert _mount_of(deep) == _Mount(str(root / "mnt" / "a"), "fuse.gcsfuse")
    assert _mount_of(str(root / "mnt" / "a")) == _Mount(str(root / "mnt" / "a"), "fuse.gcsfuse")
    assert _mount_of(ab) == _Mount(mnt, "nfs4")  # `/mnt/a` does not contain `/mnt/ab`
    assert _mount_of(other) == _Mount("/", "ext4")
    assert _mount_of(str(root / "mnt" / "not-yet" / "made")) == _Mount(mnt, "nfs4")


def test_a_mount_point_with_spaces(root, fake_proc):
    (spaced,) = folders(root, "with space/dir")
    fake_proc.set_mounts([("/", "ext4"), (root / "with space", "lustre")])
    assert (fake_proc.proc / "self" / "mounts").read_text().count("with\\040space") == 1
    assert _mount_of(spaced) == _Mount(str(root / "with space"), "lustre")


def test_the_last_of_several_mounts_at_one_point_hides_the_others(root, fake_proc):
    (mnt,) = folders(root, "mnt")
    fake_proc.set_mounts([("/", "ext4"), (mnt, "ext4"), (mnt, "fuse.s3fs")])
    assert _mount_of(mnt) == _Mount(mnt, "fuse.s3fs")


def test_symlinks_are_resolved(root, fake_proc):
    bucket, local = folders(root, "bucket", "local")
    (root / "link").symlink_to(bucket)
    (root / "bucket" / "back").symlink_to(local)
    fake_proc.set_mounts([("/", "ext4"), (bucket, "fuse.gcsfuse")])
    assert _mount_of(str(root / "link")) == _Mount(bucket, "fuse.gcsfuse")
    assert _mount_of(str(root / "bucket" / "back")) == _Mount("/", "ext4")


def test_no_mount_when_the_mount_table_cannot_be_read(root, fake_proc, monkeypatch):
    assert _mount_of(str(root)) is None  # the fake has no `self/mounts`
    fake_proc.set_mounts([("/", "nfs4")])
    assert _mount_of(str(root)) == _Mount("/", "nfs4")
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed: `import psutil` raises ImportError
    assert _mount_of(str(root)) is None


@pytest.mark.parametrize("fstype", REMOTE + LOCAL)
def test_chunks_are_fsynced_unless_fsync_uploads_or_waits_on_a_server(root, fake_proc, fstype):
    (mnt,) = folders(root, "mnt")
    fake_proc.set_mounts([("/", "ext4"), (mnt, fstype)])
    assert _fsync_waits_on_server(fstype) == (fstype in REMOTE)
    policy = _chunk_fsync_policy(mnt)
    assert policy.fsync_chunks == (fstype not in REMOTE)
    if fstype in REMOTE:
        assert policy.reason == (
            f"{mnt!r} is on a `{fstype}` mount ({mnt}), where `fsync` uploads the file or waits on the server"
        )
        assert policy.log_key == _Mount(mnt, fstype)
    else:
        assert policy.reason is None
    # a folder of its own next to the mount is not on it
    assert _chunk_fsync_policy(folders(root, "mnt2")[0]).fsync_chunks


def test_chunks_are_fsynced_when_the_mount_table_cannot_be_read(root, fake_proc):
    assert _chunk_fsync_policy(str(root)).fsync_chunks


@pytest.mark.parametrize("fstype", ["fuse.gcsfuse", "ext4"])
@pytest.mark.parametrize("value", ["1", " 1 ", "0", "auto", "AUTO", ""])
def test_the_environment_variable_overrides_the_mount_table(root, fake_proc, monkeypatch, fstype, value):
    fake_proc.set_mounts([("/", fstype)])
    monkeypatch.setenv(CHUNK_FSYNC_ENV, value)
    expected = {"1": True, "0": False}.get(value.strip(), fstype == "ext4")
    policy = _chunk_fsync_policy(str(root))
    assert policy.fsync_chunks == expected
    if value == "0":
        assert policy.reason == f"`{CHUNK_FSYNC_ENV}=0`" and policy.log_key == CHUNK_FSYNC_ENV


@pytest.mark.parametrize("value", ["yes", "true", "2", "-1", "on"])
def test_invalid_values_of_the_environment_variable_are_refused(root, fake_proc, monkeypatch, value):
    monkeypatch.setenv(CHUNK_FSYNC_ENV, value)
    with pytest.raises(MisconfigurationException, match=rf"`{CHUNK_FSYNC_ENV}` must be `auto`.*`1`.*`0`.*{value!r}"):
        _chunk_fsync_policy(str(root))
    # refused before the temporary file is made
    with pytest.raises(MisconfigurationException, match=CHUNK_FSYNC_ENV):
        _StreamedCheckpointFile(root / "out" / "model.ckpt")
    assert not (root / "out").exists()


@pytest.fixture
def os_calls(monkeypatch):
    """The calls of ``os.fdatasync``, ``os.fsync``, ``os.posix_fadvise`` and ``os.replace``, in order, as ``(name,
    "file" | "dir")`` (``os.replace``: ``(name, destination)``); each wrapper calls the real function."""
    calls = []

    def wrap(name):
        real = getattr(os, name)

        def wrapper(*args, **kwargs):
            if name == "replace":
                calls.append((name, str(args[1])))
            else:
                calls.append((name, "dir" if stat.S_ISDIR(os.fstat(args[0]).st_mode) else "file"))
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, wrapper)

    for name in ("fdatasync", "fsync", "posix_fadvise", "replace"):
        wrap(name)
    return calls


@pytest.mark.skipif(not _streamed_save_available(), reason="needs torch >= 2.5")
@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
@pytest.mark.parametrize("fstype", ["fuse.gcsfuse", "ext4"])
def test_the_streamed_file_is_fsynced_per_chunk_only_where_that_is_local(root, fake_proc, os_calls, fstype):
    (mnt,) = folders(root, "mnt")
    fake_proc.set_mounts([("/", "ext4"), (mnt, fstype)])
    pending = fake_tensors(*[(64,)] * 4)  # 256 bytes each: every write reaches `flush_bytes`
    values = [torch.arange(64.0) + 100 * i for i in range(4)]
    path = os.path.join(mnt, "model.ckpt")
    writer = _StreamedCheckpointFile(path, flush_bytes=256)
    writer.write_skeleton({"state_dict": {f"w{i}": t for i, t in enumerate(pending)}, "step": 7}, pending)
    for placeholder, value in zip(pending, values):
        writer.write(placeholder, value[:32])
        writer.write(placeholder, value[32:], element_offset=32)
    # one for each 256 bytes of values: the skeleton's few bytes are flushed with them, not on their own
    flushes = len(pending)
    before_commit = list(os_calls)
    writer.commit()

    assert before_commit.count(("posix_fadvise", "file")) == flushes
    assert before_commit.count(("fdatasync", "file")) == (flushes if fstype == "ext4" else 0)
    assert not [call for call in before_commit if call[0] in ("fsync", "replace")]
    assert os_calls[len(before_commit) :] == [("fsync", "file"), ("replace", path), ("fsync", "dir")]

    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 7
    for i, value in enumerate(values):
        assert torch.equal(loaded["state_dict"][f"w{i}"], value)


def test_skipped_chunk_fsyncs_are_logged_once_per_mount(root, fake_proc, monkeypatch):
    logged = []
    monkeypatch.setattr(checkpoint_flush, "rank_zero_info", logged.append)
    bucket, sub, other, local = folders(root, "bucket", "bucket/sub", "other", "local")
    fake_proc.set_mounts([("/", "ext4"), (bucket, "fuse.gcsfuse"), (other, "nfs4")])
    for folder in (bucket, sub, bucket, other, local, other):
        _StreamedCheckpointFile(os.path.join(folder, "model.ckpt")).discard()
    assert logged == [
        f"`DDPFullyShardedStrategy`: {bucket!r} is on a `fuse.gcsfuse` mount ({bucket}), where `fsync` uploads the"
        " file or waits on the server: the streamed checkpoint is `fsync`-ed only once, before it is renamed into"
        f" place, not every 64 MiB (set `{CHUNK_FSYNC_ENV}=1` to flush every chunk).",
        f"`DDPFullyShardedStrategy`: {other!r} is on a `nfs4` mount ({other}), where `fsync` uploads the file or"
        " waits on the server: the streamed checkpoint is `fsync`-ed only once, before it is renamed into place, not"
        f" every 64 MiB (set `{CHUNK_FSYNC_ENV}=1` to flush every chunk).",
    ]

    monkeypatch.setenv(CHUNK_FSYNC_ENV, "0")
    for folder in (local, bucket):
        _StreamedCheckpointFile(os.path.join(folder, "model.ckpt"), flush_bytes=2**20).discard()
    assert logged[2:] == [
        f"`DDPFullyShardedStrategy`: `{CHUNK_FSYNC_ENV}=0`: the streamed checkpoint is `fsync`-ed only once, before it"
        " is renamed into place, not every 1 MiB."
    ]
