"""The one storage interface of the fork's checkpoints (``write``, ``commit``, ``discard``, ``read_ranges``), the same
test for each of its three implementations: a local file, a multipart object in a real S3 server process (moto's,
``tests/helpers/s3.py``), and a sequential stream (``memory://``)."""
import os
from typing import Any, Dict, Iterator, List, Tuple

import fsspec
import pytest
import torch

from fsdp_harness.s3_server import boto3_client
from tests.helpers.runif import RunIf
from pytorch_lightning.utilities.checkpoint_storage import _CheckpointStorage
from pytorch_lightning.utilities.checkpoint_storage_kinds import _storage_for_reading, _storage_kind
from pytorch_lightning.utilities.local_file_storage import _LocalFileStorage
from pytorch_lightning.utilities.multipart_upload import _MultipartUpload
from pytorch_lightning.utilities.object_storage import _MultipartObjectStorage, _SequentialStreamStorage

pytest_plugins = ["tests.helpers.s3"]

MiB = 2**20
#: a checkpoint of three S3 parts, the last one short
SIZE = 2 * 5 * MiB + 4321
PART_OFFSETS = (0, 5 * MiB, 10 * MiB)


class _Case:
    """One kind of storage: where its checkpoint goes, how to make a storage that writes it (with global rank 0's
    staged file) or reads it, and what is left of unfinished saves."""

    def __init__(self, kind: str, url: str, tmp_path: Any, fs: Any, endpoint: str = "") -> None:
        self.kind, self.url, self.fs, self.tmp_path, self.endpoint = kind, url, fs, tmp_path, endpoint

    def staged(self) -> str:
        path = str(self.tmp_path / "staged.tmp")
        with open(path, "wb") as f:
            f.truncate(SIZE)
        return path

    def writer(self) -> _CheckpointStorage:
        staged = self.staged()
        if self.kind == "local":
            return _LocalFileStorage(self.url, staged)
        if self.kind == "multipart":
            upload = _MultipartUpload.start(self.fs, self.url)
            return _MultipartObjectStorage(self.url, upload, staged, SIZE).with_parts(PART_OFFSETS)
        return _SequentialStreamStorage(self.url, staged)

    def reader(self) -> _CheckpointStorage:
        if self.kind == "local":
            return _LocalFileStorage(self.url, "")
        etag = self.fs.info(self.url).get("ETag") if self.kind == "multipart" else None
        return _storage_for_reading(self.url, etag)

    def put(self, data: bytes) -> None:
        with self.fs.open(self.url, "wb") as f:
            f.write(data)
        self.fs.invalidate_cache()

    def get(self) -> bytes:
        self.fs.invalidate_cache()
        return self.fs.cat_file(self.url)

    def unfinished_uploads(self) -> List[Dict[str, Any]]:
        if self.kind != "multipart":
            return []
        bucket = self.url[len("s3://") :].split("/", 1)[0]
        return boto3_client(self.endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.fixture(params=["local", "multipart", "sequential"])
def case(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[_Case]:
    kind = request.param
    if kind == "local":
        (tmp_path / "run").mkdir()
        yield _Case(kind, str(tmp_path / "run" / "last.ckpt"), tmp_path, fsspec.filesystem("file"))
    elif kind == "multipart":
        server = request.getfixturevalue("s3_server")
        request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("s3_bucket")
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        yield _Case(kind, f"s3://{bucket}/run/last.ckpt", tmp_path, fs, server.endpoint)
    else:
        from pytorch_lightning.utilities import object_storage

        # the copy into the stream then takes several blocks
        request.getfixturevalue("monkeypatch").setattr(object_storage, "_COPY_BYTES", MiB)
        fs = fsspec.filesystem("memory")
        url = f"memory://storage-test-{os.getpid()}-{tmp_path.name}/last.ckpt"
        yield _Case(kind, url, tmp_path, fs)
        fs.rm(url.rsplit("/", 1)[0], recursive=True)


def _content() -> torch.Tensor:
    return torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def _extents(content: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
    """The content as the parts of :data:`PART_OFFSETS`, written by "two ranks" in two calls (the last part first)."""
    ends = PART_OFFSETS[1:] + (SIZE,)
    return [(start, content[start:end]) for start, end in zip(PART_OFFSETS, ends)]


def test_the_kinds_of_paths(tmp_path):
    assert _storage_kind(tmp_path / "a.ckpt") == "local"
    assert _storage_kind("s3://bucket/a.ckpt") == "multipart"
    assert _storage_kind("memory://bucket/a.ckpt") == "sequential"
    for reader in (_storage_for_reading("s3://bucket/a.ckpt"), _storage_for_reading("memory://bucket/a.ckpt")):
        with pytest.raises(ValueError, match="made for reading only"):
            reader.write([(0, torch.zeros(1, dtype=torch.uint8))])


@pytest.mark.timeout(60)
def test_a_storage_commits_what_every_writer_wrote_and_reads_it_back(case):
    """What ``write`` calls wrote (in any order) appears at the URL only at ``commit``, byte for byte, replacing the
    earlier checkpoint; the staged file is gone; ``read_ranges`` gives back any ranges of it."""
    case.put(b"earlier")
    content = _content()
    storage = case.writer()
    extents = _extents(content)
    receipts = storage.write(extents[2:]) + storage.write(extents[:2])
    assert case.get() == b"earlier"
    storage.commit(receipts)
    assert case.get() == content.numpy().tobytes()
    assert not os.path.exists(storage.staged)
    ranges = [(0, 10), (5 * MiB - 3, 5 * MiB + 3), (SIZE - 100, SIZE)]
    data = case.reader().read_ranges(ranges)
    assert data == [content[start:end].numpy().tobytes() for start, end in ranges]
    assert case.unfinished_uploads() == []


@pytest.mark.timeout(60)
def test_a_discarded_save_leaves_the_earlier_checkpoint_and_nothing_else(case):
    case.put(b"earlier")
    storage = case.writer()
    storage.write(_extents(_content())[:1])
    storage.discard()
    assert case.get() == b"earlier"
    assert not os.path.exists(storage.staged)
    assert case.unfinished_uploads() == []


@pytest.mark.timeout(60)
def test_a_read_of_a_replaced_checkpoint_fails(case):
    """A reader pinned to one version (S3's ETag) refuses a replaced object; a range past the end fails everywhere."""
    case.put(bytes(1000))
    reader = case.reader()
    if case.kind == "multipart":
        case.put(b"x" * 1000)  # the same size: only the version tells
        with pytest.raises(OSError, match="was replaced while it was loaded"):
            reader.read_ranges([(0, 10)])
        reader = case.reader()
    with pytest.raises(OSError, match="gave 100 bytes, not 300"):
        reader.read_ranges([(900, 1200)])


@pytest.mark.timeout(60)
def test_a_multipart_object_takes_whole_parts_only(s3_server, s3_env, s3_bucket, tmp_path):
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    url = f"s3://{s3_bucket}/run/last.ckpt"
    upload = _MultipartUpload.start(fs, url)
    storage = _MultipartObjectStorage(url, upload, None, SIZE).with_parts(PART_OFFSETS)
    content = _content()
    try:
        for offset, data in [(1, content[1 : 5 * MiB + 1]), (0, content[: 5 * MiB - 1]), (SIZE, content[:0])]:
            with pytest.raises(ValueError, match="not one part"):
                storage.write([(offset, data)])
    finally:
        storage.discard()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=RunIf(min_gpus=1))])
def test_a_local_file_takes_byte_ranges_in_steps(tmp_path, monkeypatch, device):
    """A rank's writes land at their offsets, CPU memory directly and GPU memory through the pinned staging buffer,
    in steps smaller than the range, and nowhere else."""
    from pytorch_lightning.utilities import local_file_storage

    monkeypatch.setattr(local_file_storage, "STAGING_BYTES", 8)
    path = tmp_path / "file.tmp"
    path.write_bytes(bytes(64))
    data = torch.arange(12, dtype=torch.float32, device=device).view(torch.uint8)
    storage = _LocalFileStorage(str(tmp_path / "file"), str(path), fsync_chunks=True, flush_bytes=8)
    assert storage.write([(40, data[4:24])]) == []
    assert path.read_bytes()[40:60] == data.cpu().numpy().tobytes()[4:24]
    assert path.read_bytes()[:40] == bytes(40) and path.stat().st_size == 64
