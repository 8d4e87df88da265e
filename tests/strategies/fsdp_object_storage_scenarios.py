"""Multi-process scenarios of FSDP checkpoints in object storage (S3, through s3fs), run as
``python -m tests.strategies.fsdp_object_storage_scenarios``; driven by ``test_ddp_fully_sharded_object_storage.py``
against a real S3 server process with a proxy per rank (``S3_HARNESS_RANK_ENDPOINTS``, see
``fsdp_harness/s3_server.py``). Each rank reads its own proxy's byte counts around each step, and sets its faults.
"""
import argparse
import os
import signal
import threading
import uuid
import zipfile
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, Iterator, List, Optional, Tuple
from unittest import mock

import fsspec
import torch

from fsdp_harness.models import FSDPModel, full_parameters
from fsdp_harness.s3_proxy import S3Proxy, internal_error, reset_part, slow_down
from fsdp_harness.s3_server import RANK_ENDPOINTS_ENV, boto3_client, use_rank_endpoint
from fsdp_harness.scenario import global_rank, main, quiet_trainer_kwargs
from pytorch_lightning import LightningDataModule, Trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import fsdp_ranged_load
from pytorch_lightning.utilities.exceptions import CheckpointError
from pytorch_lightning.utilities.multipart_upload import _MultipartUpload
from tests.strategies.fsdp_stream_scenarios import default_strategy, differences, load
from tests.trainer.connectors.slurm_requeue_scenarios import BATCHES, RecordRestored, SIGNALLED_BATCH, Signaller

FAULTS = {
    "internal_error": lambda: internal_error(),
    "slow_down": lambda: slow_down(times=2),
    "reset": lambda: reset_part(after_bytes=2**20),
}


def _model(args: argparse.Namespace) -> FSDPModel:
    return FSDPModel(
        width=args.width, units=3, extra_before=True, extra_after=True, optimizer=args.optimizer, scheduler=True
    )


def _trainer(args: argparse.Namespace, **kwargs: Any) -> Trainer:
    options = dict(strategy=default_strategy(), max_steps=2, limit_val_batches=0)
    return Trainer(**quiet_trainer_kwargs(args.out, args.devices, **{**options, **kwargs}))


def _proxy() -> S3Proxy:
    endpoint = use_rank_endpoint(global_rank())
    assert endpoint is not None, "the ranks need S3_HARNESS_RANK_ENDPOINTS"
    return S3Proxy.at(endpoint)


@contextmanager
def _counted(proxy: S3Proxy, into: Dict[str, Any]) -> Iterator[None]:
    """The bytes this rank sent to (``sent``) and received from (``received``) the server within the block, by
    operation."""
    before = proxy.counts()["by_op"]
    yield
    after = proxy.counts()["by_op"]
    for op, count in after.items():
        old = before.get(op, {})
        into[op] = {key: count[key] - old.get(key, 0) for key in ("requests", "sent", "received")}


def _bucket_and_key(url: str) -> List[str]:
    return url[len("s3://") :].split("/", 1)


def _uploads_in_progress(url: str) -> List[str]:
    bucket, key = _bucket_and_key(url)
    # not ``use_rank_endpoint(0)``: on another rank, it would point that rank's next S3 client at rank 0's proxy
    endpoint = os.environ[RANK_ENDPOINTS_ENV].split(",")[0]
    answer = boto3_client(endpoint).list_multipart_uploads(Bucket=bucket, Prefix=key)
    return [upload["Key"] for upload in answer.get("Uploads", [])]


def upload_equals_local(args: argparse.Namespace) -> Dict[str, Any]:
    """Fit, save into ``args.url`` and into a local file; global rank 0 downloads the object and compares it with
    the local file, byte for byte and tensor by tensor, and checks its CRC-32s (``zipfile``). With
    ``args.writers`` as the strategy's ``checkpoint_writers``."""
    proxy = _proxy()
    seed_everything(7)
    trainer = _trainer(args, strategy=default_strategy(checkpoint_writers=args.writers))
    trainer.fit(_model(args))
    url = f"{args.url}/upload-{args.writers}.ckpt"
    result: Dict[str, Any] = {"rank": trainer.global_rank, "save": {}}
    with _counted(proxy, result["save"]):
        trainer.save_checkpoint(url)
    result["reason"] = trainer.strategy._checkpoint_state.last_stream_reason
    local = args.out / "local.ckpt"
    trainer.save_checkpoint(local)
    if trainer.global_rank == 0:
        downloaded = args.out / "downloaded.ckpt"
        with fsspec.open(url, "rb") as source:
            downloaded.write_bytes(source.read())
        result["same_bytes"] = downloaded.read_bytes() == local.read_bytes()
        result["size"] = downloaded.stat().st_size
        result["differences"] = differences(load(str(downloaded)), load(str(local)))
        with zipfile.ZipFile(downloaded) as archive:
            result["testzip"] = archive.testzip()
        result["plain_torch_load"] = len(torch.load(downloaded, weights_only=False)["state_dict"])
        result["uploads_in_progress"] = _uploads_in_progress(url)
        # a copy with one flipped bit in the middle of its largest tensor record, for ``resume_corrupt``
        with zipfile.ZipFile(downloaded) as archive:
            largest = max(archive.infolist(), key=lambda info: info.file_size)
        data = bytearray(downloaded.read_bytes())
        data[largest.header_offset + 200 + largest.file_size // 2] ^= 0x10
        fsspec.filesystem("s3").pipe_file(f"{args.url}/corrupt-{args.writers}.ckpt", bytes(data))
    return result


def resume_corrupt(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from the object ``args.ckpt``, which has a flipped bit: what every rank raises."""
    _proxy()
    trainer = _trainer(args, max_steps=4)
    try:
        trainer.fit(_model(args), ckpt_path=args.ckpt)
    except CheckpointError as ex:
        return {"rank": trainer.global_rank, "error": str(ex), "global_step": trainer.global_step}
    return {"rank": trainer.global_rank, "error": None, "global_step": trainer.global_step}


def resume_from_object(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from the object ``args.ckpt`` and from the local file ``args.local`` (the same checkpoint), train 2
    more steps each; every rank compares the full parameters of the two runs."""
    proxy = _proxy()
    finals = []
    counts: Dict[str, Any] = {}
    for path in (args.ckpt, args.local):
        seed_everything(11)
        model = _model(args)
        trainer = _trainer(args, max_steps=4)
        with _counted(proxy, counts) if path == args.ckpt else nullcontext():
            trainer.fit(model, ckpt_path=path)
        finals.append({k: v.clone() for k, v in full_parameters(model).items()})
        step = trainer.global_step
    # ``validate`` restores the model only: the optimizer state is not fetched
    seed_everything(11)
    model, validate = _model(args), {}
    with _counted(proxy, validate):
        _trainer(args).validate(model, ckpt_path=args.ckpt, verbose=False)
    saved = load(args.local)["state_dict"]
    restored = {k: v for k, v in full_parameters(model).items()}
    return {
        "rank": trainer.global_rank,
        "global_step": step,
        "differences": differences(finals[0], finals[1]),
        "load": counts,
        "validate": validate,
        "validate_differences": differences(restored, {k: saved[k] for k in restored}),
    }


def _saved_then_changed(args: argparse.Namespace, name: str) -> Tuple[S3Proxy, Trainer, str, bytes]:
    """Fit, save into ``args.url``/``name`` and change every parameter, a change that must not reach the object
    where the next save fails: this rank's proxy, the trainer, the URL and (on global rank 0) the object's bytes."""
    proxy = _proxy()
    seed_everything(5)
    trainer = _trainer(args)
    trainer.fit(_model(args))
    url = f"{args.url}/{name}"
    trainer.save_checkpoint(url)
    before = fsspec.filesystem("s3").cat_file(url) if trainer.global_rank == 0 else b""
    with torch.no_grad():
        for parameter in trainer.lightning_module.parameters():
            parameter.add_(1.0)
    return proxy, trainer, url, before


def upload_fault(args: argparse.Namespace) -> Dict[str, Any]:
    """Save into ``args.url``, then save over it while global rank ``args.fault_rank``'s proxy injects
    ``args.fault``; record what every rank raised, and on rank 0 whether the object changed and whether an
    upload was left."""
    proxy, trainer, url, before = _saved_then_changed(args, f"fault-{args.fault}.ckpt")
    if trainer.global_rank == args.fault_rank:
        proxy.set_faults([FAULTS[args.fault]()])
    result: Dict[str, Any] = {"rank": trainer.global_rank, "error": None}
    try:
        trainer.save_checkpoint(url)
    except CheckpointError as ex:
        result["error"] = str(ex)
    finally:
        if trainer.global_rank == args.fault_rank:
            result["fired"] = sum(fault["fired"] for fault in proxy.faults())
            proxy.set_faults([])
    if trainer.global_rank == 0:
        fs = fsspec.filesystem("s3")
        fs.invalidate_cache()
        after = fs.cat_file(url)
        result["unchanged"] = after == before
        result["uploads_in_progress"] = _uploads_in_progress(url)
    return result


def checkpoint_callback(args: argparse.Namespace) -> Dict[str, Any]:
    """``ModelCheckpoint`` into ``args.url`` every step, ``save_top_k=2`` by step and ``save_last=True``, saving in
    the background where ``args.async_checkpoint``: which objects are left, which threads uploaded the parts, and on
    every rank whether ``last.ckpt`` holds the final parameters."""
    proxy = _proxy()
    threads: List[str] = []
    upload = _MultipartUpload.upload

    def recording_upload(self: _MultipartUpload, *a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return upload(self, *a, **kw)

    seed_everything(13)
    model = _model(args)
    directory = f"{args.url}/callback-{'async' if args.async_checkpoint else 'sync'}"
    callback = ModelCheckpoint(
        dirpath=directory, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    strategy = default_strategy(async_checkpoint=args.async_checkpoint)
    trainer = _trainer(args, strategy=strategy, max_steps=4, callbacks=[callback], enable_checkpointing=True)
    # a directory with an object in it: ``ModelCheckpoint`` lists it at the start (s3fs caches that listing)
    fsspec.filesystem("s3").pipe_file(f"{directory}/notes.txt", b"notes")
    counts: Dict[str, Any] = {}
    with mock.patch.object(_MultipartUpload, "upload", recording_upload), _counted(proxy, counts):
        trainer.fit(model)
    final = full_parameters(model)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    last = torch.load(fs.open(f"{directory}/last.ckpt", "rb"), weights_only=False, map_location="cpu")["state_dict"]
    return {
        "rank": trainer.global_rank,
        "objects": sorted(path.rsplit("/", 1)[1] for path in fs.ls(directory)),
        "best_k": sorted(path.rsplit("/", 1)[1] for path in callback.best_k_models),
        "threads": sorted(set(threads)),
        "last_differences": differences({k: last[k] for k in final}, final),
        "sent": counts.get("UploadPart", {}).get("sent", 0),
        "saves": sum(1 for t in threads),
    }


def slurm_requeue(args: argparse.Namespace) -> Dict[str, Any]:
    """A Slurm job (every rank a task of a fake ``srun``) whose root directory is ``args.url``: ``SIGUSR1`` inside a
    backward pass saves the HPC checkpoint there (in the background, ``async_checkpoint=True``) and requeues the job
    (the fake ``scontrol`` records what the bucket holds then); a second fit in the same root resumes from it."""
    os.environ["FAKE_SCONTROL_DIR"] = root = f"{args.url}/slurm"
    os.environ["FAKE_SCONTROL_LOG"] = str(args.out)
    (args.out / "pids").mkdir(parents=True, exist_ok=True)
    (args.out / "pids" / f"task{os.environ['SLURM_PROCID']}").write_text(str(os.getpid()))
    proxy = _proxy()
    fits = []
    for seed, signaller in ((1, Signaller(args.out, in_batch=SIGNALLED_BATCH)), (2, Signaller(args.out))):
        seed_everything(seed)
        restored = RecordRestored()
        strategy = default_strategy(async_checkpoint=True)
        options = dict(default_root_dir=root, callbacks=[signaller, restored], max_steps=-1, max_epochs=seed)
        trainer = _trainer(args, strategy=strategy, **options)
        counts: Dict[str, Any] = {}
        with _counted(proxy, counts):
            trainer.fit(FSDPModel(width=args.width, units=3, batches=BATCHES))
        fits.append(
            {
                "received": len(signaller.received),
                "start_step": restored.step,
                "end": trainer.global_step,
                "uploaded_parts": counts.get("UploadPart", {}).get("requests", 0),
            }
        )
    return {"rank": trainer.global_rank, "fits": fits}


def killed_mid_upload(args: argparse.Namespace) -> Dict[str, Any]:
    """Save into ``args.url``, then save over it; in the second save's upload global rank ``args.fault_rank`` (or
    every rank: ``-1``) kills itself (``SIGKILL``) before its first part. A rank left records what it raised, and on
    global rank 0 whether the object changed and which uploads are left."""
    proxy, trainer, url, before = _saved_then_changed(args, "killed.ckpt")
    upload = _MultipartUpload.upload

    def killing_upload(self: _MultipartUpload, *a: Any, **kw: Any) -> Any:
        if args.fault_rank in (-1, trainer.global_rank):
            os.kill(os.getpid(), signal.SIGKILL)
        return upload(self, *a, **kw)

    result: Dict[str, Any] = {"rank": trainer.global_rank, "error": None}
    with _counted(proxy, result.setdefault("save", {})):
        try:
            with mock.patch.object(_MultipartUpload, "upload", killing_upload):
                trainer.save_checkpoint(url)
        except CheckpointError as ex:
            result["error"] = str(ex)
    if trainer.global_rank == 0:
        fs = fsspec.filesystem("s3")
        fs.invalidate_cache()
        result["unchanged"] = fs.cat_file(url) == before
        result["uploads_in_progress"] = _uploads_in_progress(url)
    return result


def after_killed_job(args: argparse.Namespace) -> Dict[str, Any]:
    """The next job after one killed mid-upload: record the uploads and markers left in ``args.url``, then resume
    from ``killed.ckpt`` there (global rank 0 aborts the killed job's upload) and record them again."""
    _proxy()
    url = f"{args.url}/killed.ckpt"
    fs = fsspec.filesystem("s3")

    def markers() -> List[str]:
        fs.invalidate_cache()
        return sorted(p.rsplit("/", 1)[1] for p in fs.ls(args.url) if p.endswith(".upload"))

    result: Dict[str, Any] = {"before": {"uploads": _uploads_in_progress(url), "markers": markers()}}
    trainer = _trainer(args, max_steps=3)
    trainer.fit(_model(args), ckpt_path=url)
    result.update(rank=trainer.global_rank, after={"uploads": _uploads_in_progress(url), "markers": markers()})
    return result


class ReadsCheckpointData(LightningDataModule):
    """A DataModule whose ``on_load_checkpoint`` reads a full FSDP weight of the checkpoint (1.6.5 hands it the whole
    checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Optional[torch.Tensor] = None

    def train_dataloader(self) -> Any:
        return self.trainer.lightning_module.train_dataloader()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.seen = checkpoint["state_dict"]["layer.0.0.weight"].clone()


def resume_reading_hooks(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from the object ``args.ckpt`` with a DataModule whose ``on_load_checkpoint`` reads a full weight: what
    it saw against the local file ``args.local``, and the bytes this rank fetched."""
    proxy = _proxy()
    datamodule, counts = ReadsCheckpointData(), {}
    trainer = _trainer(args, max_steps=3)
    with _counted(proxy, counts):
        trainer.fit(_model(args), datamodule=datamodule, ckpt_path=args.ckpt)
    expected = load(args.local)["state_dict"]["layer.0.0.weight"]
    return {"rank": trainer.global_rank, "same": bool(torch.equal(datamodule.seen, expected)), "load": counts}


def resume_missing_range(args: argparse.Namespace) -> Dict[str, Any]:
    """Resume from the object ``args.ckpt`` while the choice of the ranges to fetch leaves out one tensor's bytes
    (a bug that would hand the restore zeros): what every rank raises."""
    _proxy()
    choose = fsdp_ranged_load._ranges_read

    def dropping(*a: Any, **kw: Any) -> List[Any]:
        ranges = sorted(choose(*a, **kw), key=lambda r: r[0] - r[1])
        return ranges[1:]  # the largest range left out

    trainer = _trainer(args, max_steps=3)
    try:
        with mock.patch.object(fsdp_ranged_load, "_ranges_read", dropping):
            trainer.fit(_model(args), ckpt_path=args.ckpt)
    except CheckpointError as ex:
        return {"rank": trainer.global_rank, "error": str(ex)}
    return {"rank": trainer.global_rank, "error": None}


def part_size_differs(args: argparse.Namespace) -> Dict[str, Any]:
    """Save into ``args.url`` with ``PL_CHECKPOINT_PART_BYTES`` 5 MiB on global rank 0 and 6 MiB on the others:
    every rank cuts the object as rank 0 does. Rank 0 compares the object with a local save."""
    _proxy()
    seed_everything(3)
    trainer = _trainer(args)
    trainer.fit(_model(args))
    if trainer.global_rank:
        os.environ["PL_CHECKPOINT_PART_BYTES"] = str(6 * 2**20)
    url, local = f"{args.url}/part-size.ckpt", args.out / "local.ckpt"
    trainer.save_checkpoint(url)
    trainer.save_checkpoint(local)
    result: Dict[str, Any] = {"rank": trainer.global_rank}
    if trainer.global_rank == 0:
        result["same_bytes"] = fsspec.filesystem("s3").cat_file(url) == local.read_bytes()
    return result


def sequential_store(args: argparse.Namespace) -> Dict[str, Any]:
    """Save into ``memory://`` (an fsspec filesystem without multipart uploads, as gcsfs or adlfs are: global rank 0
    writes it from its scratch file, each process's memory being its own) and into a local file; rank 0 compares
    them. In a single process, resume from both and compare the parameters reached."""
    seed_everything(17)
    trainer = _trainer(args)
    trainer.fit(_model(args))
    url, local = f"memory://run-{args.devices}/sequential.ckpt", args.out / "local.ckpt"
    trainer.save_checkpoint(url)
    reason = trainer.strategy._checkpoint_state.last_stream_reason
    result: Dict[str, Any] = {"rank": trainer.global_rank, "reason": reason}
    trainer.save_checkpoint(local)
    if trainer.global_rank == 0:
        result["same_bytes"] = fsspec.filesystem("memory").cat_file(url) == local.read_bytes()
    if args.devices == 1:
        finals = []
        for path in (url, str(local)):
            seed_everything(19)
            model = _model(args)
            _trainer(args, max_steps=4).fit(model, ckpt_path=path)
            finals.append({k: v.clone() for k, v in full_parameters(model).items()})
        result["differences"] = differences(finals[0], finals[1])
    return result


def missing_bucket(args: argparse.Namespace) -> Dict[str, Any]:
    """Save into a bucket that does not exist: what every rank raises, and whether the bucket appeared."""
    _proxy()
    trainer = _trainer(args)
    trainer.fit(_model(args))
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    result: Dict[str, Any] = {"rank": trainer.global_rank, "error": None}
    try:
        trainer.save_checkpoint(f"s3://{bucket}/run/a.ckpt")
    except CheckpointError as ex:
        result["error"] = str(ex)
    if trainer.global_rank == 0:
        names = [b["Name"] for b in boto3_client(S3Proxy.at(use_rank_endpoint(0)).endpoint).list_buckets()["Buckets"]]
        result["bucket_created"] = bucket in names
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="")
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--local", default="")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--fault", choices=sorted(FAULTS), default="internal_error")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--async-checkpoint", action="store_true")
    parser.add_argument("--writers", default="auto")


if __name__ == "__main__":
    main(
        {
            "upload_equals_local": upload_equals_local,
            "resume_from_object": resume_from_object,
            "resume_corrupt": resume_corrupt,
            "upload_fault": upload_fault,
            "missing_bucket": missing_bucket,
            "checkpoint_callback": checkpoint_callback,
            "slurm_requeue": slurm_requeue,
            "killed_mid_upload": killed_mid_upload,
            "after_killed_job": after_killed_job,
            "resume_reading_hooks": resume_reading_hooks,
            "resume_missing_range": resume_missing_range,
            "part_size_differs": part_size_differs,
            "sequential_store": sequential_store,
        },
        add_arguments,
    )
