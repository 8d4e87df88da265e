"""The object-storage parts of the fork in one process: S3's part rules, the parts every rank cuts, the markers of
killed uploads and their cleanup, and loads pinned to one version of an object; against a real S3 server process
(moto's, ``tests/helpers/s3.py``) where a store is involved."""
import json
import logging
import subprocess
import sys

import fsspec
import pytest
import torch

from fsdp_harness.s3_proxy import access_denied
from fsdp_harness.s3_server import apply_env, boto3_client
from pytorch_lightning.strategies.fsdp_parallel_save import _Extent
from pytorch_lightning.strategies.fsdp_parallel_upload import _cover, _parts, _rounds, PARTS_IN_FLIGHT
from pytorch_lightning.utilities.atomic_save import _writer_host_id
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.checkpoint_storage_kinds import _storage_for_reading
from pytorch_lightning.utilities.multipart_upload import _MultipartUpload, _part_size, PART_BYTES_ENV
from pytorch_lightning.utilities.sparse_object_copy import _SparseObjectCopy
from pytorch_lightning.utilities.stale_uploads import _abort_stale_uploads, STALE_UPLOAD_AGE_ENV

pytest_plugins = ["tests.helpers.s3"]

MiB = 2**20


def test_part_size_follows_s3s_rules(monkeypatch):
    monkeypatch.delenv(PART_BYTES_ENV, raising=False)
    assert _part_size(100 * MiB) == 16 * MiB
    # 840 GB needs parts of at least 84 MB to fit 10,000 of them; whole MiB
    size = _part_size(840 * 10**9)
    assert size % MiB == 0 and size >= 84 * 10**6 and -(-840 * 10**9 // size) <= 10_000
    with pytest.raises(ValueError, match="does not fit S3's 10000 parts of 5 GiB"):
        _part_size(10_000 * 5 * 2**30 + 1)
    for value in ("4194304", "abc", str(6 * 2**30)):
        monkeypatch.setenv(PART_BYTES_ENV, value)
        with pytest.raises(MisconfigurationException, match=PART_BYTES_ENV):
            _part_size(100 * MiB)
    monkeypatch.setenv(PART_BYTES_ENV, str(5 * MiB))
    assert _part_size(100 * MiB) == 5 * MiB


def _extents(size: int, world_size: int, records: int) -> list:
    """FSDP-like extents: ``records`` records spread over the file, each split evenly between the ranks, with gaps
    (the structure) between them."""
    extents, offset = [], 4096
    record = (size - 8192) // records - 128
    for _ in range(records):
        share = record // world_size
        for rank in range(world_size):
            extents.append(_Extent(offset + rank * share, share, rank, ("param", offset, rank), 0))
        offset += record + 128
    return extents


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_parts_cover_the_object_once_follow_the_shards_and_share_the_upload(world_size):
    """Every byte once, parts within S3's sizes; where the ranks' runs are at least S3's least part (2 ranks here),
    parts hold one rank's bytes but the structure's; each rank uploads its share."""
    size, part = 83 * MiB + 12345, 16 * MiB
    extents = _extents(size, world_size, records=7)
    cover = _cover(extents, size)
    parts = _parts(size, part, cover, world_size)
    assert [p.number for p in parts] == list(range(1, len(parts) + 1))
    assert all(5 * MiB <= p.nbytes <= part for p in parts[:-1]) and 0 < parts[-1].nbytes <= part
    position, moved, owned = 0, 0, [0] * world_size
    for p in parts:
        assert p.offset == position
        covered = p.offset
        for segment in p.segments:
            assert segment.offset == covered  # contiguous, no byte twice, none left out
            covered += segment.nbytes
        assert covered == p.offset + p.nbytes
        held = {}
        for segment in p.segments:
            held[segment.rank] = held.get(segment.rank, 0) + segment.nbytes
        moved += p.nbytes - held[p.owner]
        owned[p.owner] += p.nbytes
        position += p.nbytes
    assert position == size
    if world_size <= 2:
        assert moved < 0.001 * size, moved  # the structure's few bytes between the records
    # every rank uploads its share, to a part, also at 4 ranks, whose runs (2.9 MiB) are shorter than S3's least part
    assert all(abs(got - size / world_size) <= part for got in owned), owned
    rounds = _rounds(parts, world_size)
    assert sorted(p.number for r in rounds for p in r) == [p.number for p in parts]
    for r in rounds:
        for rank in range(world_size):
            assert sum(p.owner == rank for p in r) <= PARTS_IN_FLIGHT


def test_an_object_of_more_than_10000_least_parts_gets_larger_parts():
    size = 60 * 2**30  # 60 GiB: 12,288 parts of 5 MiB
    cover = [_Extent(0, size, 0, None, 0)]
    parts = _parts(size, _part_size(size), cover, 1)
    assert len(parts) <= 10_000 and all(p.nbytes <= 5 * 2**30 for p in parts)


def _start_marked_upload(fs, bucket: str, key: str, host: str, pid: int) -> str:
    upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    marker = f"{bucket}/run/.{key.rsplit('/', 1)[1]}.{host}.{pid}.0123abcd.upload"
    fs.pipe_file(marker, json.dumps({"bucket": bucket, "key": key, "upload_id": upload_id, "started": 0}).encode())
    return marker


def _uploads(endpoint: str, bucket: str) -> list:
    return sorted(u["Key"] for u in boto3_client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.timeout(60)
def test_the_uploads_of_killed_jobs_are_aborted_and_the_others_kept(s3_server, s3_env, s3_bucket, monkeypatch, caplog):
    """Markers of this host whose process is gone: aborted; of a running process: kept; of another host: kept until
    ``PL_CHECKPOINT_STALE_UPLOAD_AGE``, then aborted."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = _writer_host_id()
    _start_marked_upload(fs, s3_bucket, "run/dead.ckpt", host, int(dead.stdout))
    alive = _start_marked_upload(fs, s3_bucket, "run/alive.ckpt", host, 1)  # init: always there
    _start_marked_upload(fs, s3_bucket, "run/elsewhere.ckpt", "0" * 12, 1)
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.stale_uploads"):
        assert _abort_stale_uploads(fs, f"s3://{s3_bucket}/run") == ["run/dead.ckpt"]
    assert "Aborted 1 multipart upload(s) left behind by killed checkpoint saves" in caplog.text
    assert _uploads(s3_server.endpoint, s3_bucket) == ["run/alive.ckpt", "run/elsewhere.ckpt"]
    monkeypatch.setenv(STALE_UPLOAD_AGE_ENV, "0")
    assert _abort_stale_uploads(fs, f"s3://{s3_bucket}/run") == ["run/elsewhere.ckpt"]
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{s3_bucket}/run")) == [alive.rsplit("/", 1)[1]]
    monkeypatch.setenv(STALE_UPLOAD_AGE_ENV, "soon")
    with pytest.raises(MisconfigurationException, match=STALE_UPLOAD_AGE_ENV):
        _abort_stale_uploads(fs, f"s3://{s3_bucket}/run")


@pytest.mark.timeout(60)
def test_a_refused_listing_is_logged_not_raised(s3_server, s3_bucket, s3_proxies, monkeypatch, caplog):
    proxy = s3_proxies([access_denied("ListObjectsV2")])
    for name, value in apply_env(proxy.env(), {}).items():
        monkeypatch.setenv(name, value)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    with caplog.at_level(logging.WARNING, logger="pytorch_lightning.utilities.stale_uploads"):
        assert _abort_stale_uploads(fs, f"s3://{s3_bucket}/run") == []
    assert "Could not look for stale uploads in s3://" in caplog.text


@pytest.mark.timeout(60)
def test_an_upload_is_marked_until_it_is_completed(s3_server, s3_env, s3_bucket):
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    upload = _MultipartUpload.start(fs, f"s3://{s3_bucket}/run/a.ckpt")
    assert fs.exists(upload.marker) and json.loads(fs.cat_file(upload.marker))["upload_id"] == upload.upload_id
    parts = upload.upload(fs, [(1, bytearray(b"only part"))])
    upload.complete(fs, parts)
    assert not fs.exists(upload.marker) and fs.cat_file(f"{s3_bucket}/run/a.ckpt") == b"only part"


@pytest.mark.timeout(60)
def test_a_load_reads_one_version_of_the_object(s3_server, s3_env, s3_bucket, tmp_path):
    """The copy pins the ETag it was made for: a checkpoint replaced (same size, other bytes) between its ranged
    GETs fails the load instead of mixing the two."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    url = f"s3://{s3_bucket}/run/last.ckpt"
    for value in (1.0, 2.0):
        torch.save({"a": torch.full((100_000,), value), "b": torch.full((100_000,), value)}, tmp_path / f"{value}.ckpt")
    fs.put_file(str(tmp_path / "1.0.ckpt"), url)
    size, etag = _SparseObjectCopy.version_of(fs, url)
    copy = _SparseObjectCopy(_storage_for_reading(url, etag), size)
    try:
        copy.fetch_structure()
        fs.put_file(str(tmp_path / "2.0.ckpt"), url)
        with pytest.raises(OSError, match="was replaced while it was loaded"):
            copy.fetch([(0, copy.size)])
    finally:
        copy.close()
