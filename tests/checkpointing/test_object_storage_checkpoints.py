"""Checkpoints on an object store (the fork/object-storage-checkpoints patch), against a real S3 server process
(moto's, ``tests/helpers/s3.py``) reached through the clients' standard configuration: a save never creates a bucket,
and raises before any data moves where the bucket is missing or the client has no credentials, naming the URL
without its secrets."""
import logging
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from fsdp_harness.s3_proxy import access_denied
from fsdp_harness.s3_server import ROOT, apply_env, boto3_client
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.exceptions import CheckpointError
from tests.helpers.boring_model import BoringModel

pytest_plugins = ["tests.helpers.s3"]


def _buckets(endpoint: str) -> list:
    return sorted(bucket["Name"] for bucket in boto3_client(endpoint).list_buckets()["Buckets"])


def _kwargs(tmp_path, **overrides) -> dict:
    return quiet_trainer_kwargs(tmp_path, 1, limit_val_batches=0, enable_checkpointing=True, **overrides)


def _objects(endpoint: str, bucket: str) -> list:
    return sorted(item["Key"] for item in boto3_client(endpoint).list_objects_v2(Bucket=bucket).get("Contents", []))


@pytest.mark.timeout(120)
def test_save_into_a_missing_bucket_raises_and_creates_none(tmp_path, s3_server, s3_env, s3_bucket):
    """``Trainer.save_checkpoint`` and ``ModelCheckpoint`` into a bucket that does not exist raise a
    ``CheckpointError`` (also a ``FileNotFoundError``) naming the bucket and the URL, and no bucket is created (1.6.5
    created it: s3fs's ``makedirs`` makes the bucket); into the existing bucket the top 2 and ``last.ckpt`` are
    written as before."""
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    before = _buckets(s3_server.endpoint)
    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=2, limit_val_batches=0))
    trainer.fit(BoringModel())
    url = f"s3://{missing}/run/a.ckpt"
    with pytest.raises(CheckpointError, match=f"The bucket '{missing}' of the checkpoint path {url} does not exist"):
        trainer.save_checkpoint(f"s3://{missing}/run/a.ckpt")
    with pytest.raises(FileNotFoundError, match="Checkpoints never create a bucket"):
        trainer.save_checkpoint(f"s3://{missing}/run/a.ckpt")

    callback = ModelCheckpoint(dirpath=f"s3://{missing}/run", every_n_train_steps=1)
    trainer = Trainer(**_kwargs(tmp_path, max_steps=2, callbacks=[callback]))
    with pytest.raises(FileNotFoundError, match=f"The bucket '{missing}'"):
        trainer.fit(BoringModel())
    assert _buckets(s3_server.endpoint) == before

    callback = ModelCheckpoint(
        dirpath=f"s3://{s3_bucket}/run", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    trainer = Trainer(**_kwargs(tmp_path, max_steps=8, callbacks=[callback]))
    trainer.fit(BoringModel())
    saved = ["run/epoch=0-step=6.ckpt", "run/epoch=0-step=8.ckpt", "run/last.ckpt"]
    assert _objects(s3_server.endpoint, s3_bucket) == saved


#: a process that saves to ``s3://BUCKET/run/a.ckpt`` with the environment it is given; prints the error
_SAVE = textwrap.dedent(
    """
    import sys
    import torch
    from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
    try:
        TorchCheckpointIO().save_checkpoint({"w": torch.ones(2)}, sys.argv[1])
    except Exception as ex:
        print(type(ex).__name__, "|", ex)
    else:
        print("saved")
    """
)


@pytest.mark.timeout(120)
def test_save_without_credentials_raises_before_any_data_moves(s3_server, s3_bucket):
    """A process whose client finds no credentials (none in the environment, no configuration file, no instance
    metadata) raises ``PermissionError`` naming the URL and saying where credentials come from; the bucket stays
    empty and the message quotes no key."""
    env = s3_server.env()
    env.update(AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None, AWS_SESSION_TOKEN=None, AWS_PROFILE=None)
    url = f"s3://{s3_bucket}/run/a.ckpt"
    result = subprocess.run(
        [sys.executable, "-c", _SAVE, url], env=apply_env(env), cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr
    assert line.startswith("PermissionError | The checkpoint path " + url + " cannot be reached (NoCredentialsError)")
    assert "AWS_ACCESS_KEY_ID" in line
    assert _objects(s3_server.endpoint, s3_bucket) == []


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://bucket/run/a.ckpt", "s3://bucket/run/a.ckpt"),
        ("s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/a.ckpt", "s3://AKIDEXAMPLE:***@bucket/a.ckpt"),
        ("https://host/a.ckpt?X-Amz-Signature=abc&X-Amz-Date=1", "https://host/a.ckpt?X-Amz-Signature=***&X-Amz-Date=***"),
        ("/local/path/a.ckpt", "/local/path/a.ckpt"),
        # AWS's documented example secret holds a '/', which ends a URL's host part for urllib
        ("s3://AKIDEXAMPLE:wJalrXUtnFEMI/K7MDENG@bucket/a.ckpt", "s3://AKIDEXAMPLE:***@bucket/a.ckpt"),
        ("abfs://container@account.dfs.core.windows.net/a.ckpt", "abfs://container@account.dfs.core.windows.net/a.ckpt"),
    ],
)
def test_urls_are_shown_without_their_secrets(url, shown):
    assert _redacted(url) == shown


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(120)
def test_resume_from_an_object_store_says_it_is_not_checked(tmp_path, s3_env, s3_bucket):
    """A resume from ``s3://`` works as in 1.6.5 and says once that the file's CRC-32s are not checked, because it is
    not a local file (before, the check tried to open the URL as a local path and said ``FileNotFoundError``)."""
    url = f"s3://{s3_bucket}/run/a.ckpt"
    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=2, limit_val_batches=0))
    trainer.fit(BoringModel())
    trainer.save_checkpoint(url)
    lines = _Lines()
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(lines)
    try:
        trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=4, limit_val_batches=0))
        trainer.fit(BoringModel(), ckpt_path=url)
    finally:
        logger.removeHandler(lines)
    assert trainer.global_step == 4
    unchecked = [line for line in lines.lines if "is loaded without checking its CRC-32s" in line]
    assert unchecked == [f"The checkpoint {url!r} is loaded without checking its CRC-32s: it is not a local file (only"
                         " local files are checked)."]


@pytest.mark.timeout(120)
def test_save_where_head_bucket_is_refused(s3_server, s3_bucket, s3_proxies):
    """Through a proxy that answers S3's ``HeadBucket`` with 403 (a role without ``s3:ListBucket``, a requester-pays
    bucket), the save asks as 1.6.5's ``makedirs`` did (s3fs's ``exists``, which tries other calls) and writes the
    checkpoint; where every request is refused it raises ``PermissionError`` and writes nothing."""
    url = f"s3://{s3_bucket}/run/a.ckpt"
    denied = s3_proxies([access_denied("HeadBucket")])

    def save(proxy) -> str:
        env = apply_env(proxy.env(max_attempts=1))
        result = subprocess.run([sys.executable, "-c", _SAVE, url], env=env, cwd=ROOT, capture_output=True, text=True)
        return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr

    assert save(denied) == "saved"
    assert denied.counts()["by_op"]["HeadBucket"]["faults"] >= 1
    assert _objects(s3_server.endpoint, s3_bucket) == ["run/a.ckpt"]
    boto3_client(s3_server.endpoint).delete_object(Bucket=s3_bucket, Key="run/a.ckpt")
    line = save(s3_proxies([access_denied()]))
    assert line.startswith(f"PermissionError | The checkpoint path {url} cannot be reached"), line
    assert _objects(s3_server.endpoint, s3_bucket) == []


@pytest.mark.timeout(120)
def test_a_secret_in_the_url_stays_out_of_the_error(tmp_path, s3_env, s3_bucket):
    """A checkpoint URL that carries credentials (``s3://KEY:SECRET@bucket/...``) fails to save, and neither the
    ``CheckpointError`` nor its cause quotes the secret."""
    secret = "wJalrXUtnFEMI/K7MDENG"
    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=1, limit_val_batches=0))
    trainer.fit(BoringModel())
    with pytest.raises(CheckpointError) as info:
        trainer.save_checkpoint(f"s3://AKIDEXAMPLE:{secret}@{s3_bucket}/run/a.ckpt")
    shown = f"{info.value} {info.value.__cause__} {info.value.__context__}"
    assert secret not in shown and "wJal" not in shown, shown
    assert "AKIDEXAMPLE:***@" in str(info.value), str(info.value)


@pytest.mark.timeout(120)
def test_load_from_checkpoint_reads_an_object(tmp_path, s3_env, s3_bucket):
    """``LightningModule.load_from_checkpoint`` takes an ``s3://`` URL, as in 1.6.5 (it reads the whole object)."""
    url = f"s3://{s3_bucket}/run/a.ckpt"
    trainer = Trainer(**quiet_trainer_kwargs(tmp_path, 1, max_steps=2, limit_val_batches=0))
    model = BoringModel()
    trainer.fit(model)
    trainer.save_checkpoint(url)
    loaded = BoringModel.load_from_checkpoint(url)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
