"""One rank of one benchmark run: ``python -m fsdp_benchmarks.worker save_and_resume --config NAME --out DIR ...``.

Lightning's launcher starts ranks >= 1 by re-running this command line, so it must stay a ``python -m`` module run
from the repository root. Every rank:

1. fits the model for one short epoch (so the optimizer has state) with the configuration's strategy;
2. **save**: ``trainer.save_checkpoint(path)`` on all ranks (it is collective), measured by :class:`PeakMemory`
   from just before the call (baseline after ``malloc_trim``) until it returns (in GPU mode also the CUDA
   allocator's peak, reset just before);
3. checks the file: all ranks gather the full parameters (collective), rank 0 maps the file and compares every
   model tensor exactly, and counts the optimizer-state values in it against a full optimizer state (one value per
   parameter for SGD's momentum, two for Adam's moments). A configuration whose checkpoint is incomplete by design
   (1.6.5 saves rank 0's optimizer shard) reports the count but is not failed for it. Configurations that stream
   the save (``stream_checkpoint=True``) then save again, unmeasured, with ``strategy.stream_checkpoint = False``
   to a second file, and rank 0 compares every tensor of the model state dict and of ``optimizer_states`` between
   the two files (:mod:`fsdp_harness.tensor_compare`);
4. **resume**: a fresh model and a fresh Trainer run ``fit(ckpt_path=path)``. Measured from the moment the
   strategy starts reading the checkpoint (``strategy.load_checkpoint``; baseline taken right there) until
   ``on_train_start``, i.e. after every restore (model, loops, optimizer, schedulers) and ``resume_end``, which drops
   the loaded checkpoint. The baseline is taken where the checkpoint starts to matter, so the figure is the cost of
   the checkpoint on top of what the rank held just before, whether Lightning restores before sharding (upstream
   1.6.5) or after. The wall time covers the same window (with upstream's order it includes wrapping the model).
   Training stops at ``on_train_start``; the resumed parameters are gathered and compared with the file again. In the
   same window each rank counts the bytes its loads of the model and optimizer state read of the checkpoint's tensors,
   the bytes of the tensors its collectives carry, and the FSDP units it gathers (:mod:`fsdp_harness.checkpoint_reads`:
   the ranks of one host share a page cache, so OS counters cannot split the reads between them);
5. writes ``<out>/rank<N>.json`` (with the ``pytorch_lightning`` it imported, so the runner can check the build)
   (or, when it raises, ``<out>/rank<N>.error``; see :mod:`fsdp_harness.scenario`).

In ``save_and_resume`` and ``dcp_save_and_resume`` each rank first installs
:mod:`fsdp_benchmarks.checkpoint_io_meter` over the checkpoint directory: the save's ``bytes_written`` are this rank's
writes into it during the measured save, and with ``--write-mbps B`` every checkpoint write of the rank is throttled
to B MB/s (an emulated per-writer link, not a real one).

``dcp_save_and_resume`` is the torch DCP peer (:mod:`fsdp_benchmarks.dcp_peer`), measured the same way without
Lightning; the runner starts its ranks itself.

A remote configuration (``storage="s3"``) saves to and resumes from ``--ckpt-url`` (``s3://<bucket>/<run>/...``).
Each rank first points its S3 clients at its own proxy (``S3_HARNESS_RANK_ENDPOINTS``, set by the runner), and
:class:`ServerTraffic` reads that proxy's counts just before and after the measured save and the measured resume:
the bytes the rank sent to the server and received from it (``server_sent``/``server_received``, and per S3
operation ``server_by_op``). What the ranks exchange over gloo does not pass the proxies. Before the fit, each rank
makes its S3 client and reaches the bucket once (:func:`warm_up_client`, measured apart as ``client_setup``): a job
pays that once, at its first save, and the measured resume finds the client made as a job's later saves do. Global
rank 0 downloads the object into ``--out`` after the measured save, for the file checks, and removes the object at the
end.
"""
import argparse
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

import pytorch_lightning
from fsdp_benchmarks import checkpoint_io_meter
from fsdp_benchmarks.configs import by_name
from fsdp_benchmarks.model import STATE_SLOTS, CheckpointModel, state_dict_mb
from fsdp_harness.checkpoint_reads import LoadTraffic
from fsdp_harness.memory_sampler import MIB, PeakMemory, memory_source
from fsdp_harness.models import full_parameters
from fsdp_harness.scenario import global_rank, main
from fsdp_harness.tensor_compare import compare_tensors, iter_tensors
from pytorch_lightning import Callback, Trainer, seed_everything


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--width", type=int, default=0, help="the blocks' width (default: from --size-mb and --units)")
    parser.add_argument("--heads", type=int, default=0, help="the width of an input and an output head (0: none)")
    parser.add_argument("--optimizer", choices=["sgd", "sgd-plain", "adam"], default="sgd")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--ckpt-dir", type=Path, help="where the checkpoint is written (default: --out)")
    parser.add_argument("--steps", type=int, default=12, help="fit_with_checkpoints: training steps")
    parser.add_argument("--every", type=int, default=4, help="fit_with_checkpoints: save every N steps, 0: never")
    parser.add_argument("--write-mbps", type=float, help="throttle this rank's checkpoint writes to this many MB/s")
    parser.add_argument("--ckpt-url", help="a remote configuration's checkpoint, s3://<bucket>/<run>/<name>")


class ServerTraffic:
    """The bytes this rank sends to and receives from the S3 server, as its own proxy counts them
    (:mod:`fsdp_harness.s3_proxy`); :meth:`snapshot` before a window, :meth:`since` after it. Makes no S3 client:
    the counts come from the proxy's control endpoint, which is not traffic."""

    def __init__(self) -> None:
        from fsdp_harness.s3_proxy import S3Proxy
        from fsdp_harness.s3_server import use_rank_endpoint

        # before any S3 client of this process: botocore reads AWS_ENDPOINT_URL when a client is made
        endpoint = use_rank_endpoint(global_rank())
        if endpoint is None:
            raise RuntimeError("a remote configuration's ranks need S3_HARNESS_RANK_ENDPOINTS (set by the runner)")
        self.proxy = S3Proxy.at(endpoint)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        return self.proxy.counts()["by_op"]

    def since(self, before: Dict[str, Dict[str, int]]) -> Dict[str, Any]:
        """``server_sent``, ``server_received`` and ``server_requests`` since ``before``, and the same per operation
        (``server_by_op``, only the operations with requests)."""
        by_op = {}
        for op, count in self.snapshot().items():
            old = before.get(op, {})
            delta = {key: count[key] - old.get(key, 0) for key in ("requests", "sent", "received")}
            if any(delta.values()):
                by_op[op] = delta
        totals = {key: sum(d[key] for d in by_op.values()) for key in ("sent", "received", "requests")}
        return {**{f"server_{key}": value for key, value in totals.items()}, "server_by_op": by_op}


def describe_run(
    args: argparse.Namespace, rank: int, model: CheckpointModel, accelerator: str, write_mbps: Any
) -> Dict[str, Any]:
    """The fields every rank's result starts with: the run, the model's shape, the memory source and the build."""
    return {
        "rank": rank,
        "config": args.config,
        "world_size": args.devices,
        "accelerator": accelerator,
        "width": model.block_width,
        "heads": args.heads,
        "optimizer": args.optimizer,
        "units": args.units,
        "unit_mb": state_dict_mb(model.block_width, 1),
        "state_dict_mb": model.state_dict_mb,
        "memory_source": memory_source(),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "lightning_version": pytorch_lightning.__version__,
        "lightning_file": pytorch_lightning.__file__,
        "write_mbps": write_mbps,
    }


def make_strategy(args: argparse.Namespace) -> Any:
    config = by_name(args.config)
    if not config.agree_before_collectives:
        from pytorch_lightning.utilities import collective_guard

        collective_guard.AGREE_BEFORE_COLLECTIVES = False
    if not config.portable_optimizer_state:
        from pytorch_lightning.strategies import fsdp_portable_optimizer_state

        fsdp_portable_optimizer_state.PORTABLE_LAYOUT = False
    if not config.record_crcs:
        _without_record_crcs()
    kwargs = dict(config.strategy_kwargs)
    checkpoint_io = config.build_checkpoint_io()
    if checkpoint_io is not None:
        kwargs["checkpoint_io"] = checkpoint_io
    if args.accelerator == "gpu":
        from pytorch_lightning.strategies import DDPFullyShardedStrategy as strategy_cls
    else:
        from fsdp_harness.cpu_fsdp import CPUFullyShardedStrategy as strategy_cls
    return strategy_cls(**kwargs)


def _without_record_crcs() -> None:
    """Saves that compute and write no CRC-32 and resumes that check none (``BenchConfig.record_crcs``)."""
    from pytorch_lightning.utilities import checkpoint_crc, streamed_checkpoint_file

    checkpoint_crc._crc32 = lambda data, value=0: 0
    streamed_checkpoint_file._write_record_crcs = lambda *args: None
    os.environ["PL_CHECKPOINT_VERIFY"] = "0"


def make_model(args: argparse.Namespace) -> CheckpointModel:
    seed_everything(1234, workers=True)
    return CheckpointModel(
        args.size_mb, args.units, args.devices, optimizer=args.optimizer, width=args.width, heads=args.heads
    )


def make_trainer(args: argparse.Namespace, **overrides: Any) -> Trainer:
    kwargs = dict(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=make_strategy(args),
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(args.out),
    )
    kwargs.update(overrides)
    return Trainer(**kwargs)


def compare_with_file(model: torch.nn.Module, path: Path, rank: int) -> Dict[str, Any]:
    """Collective: gather the full parameters on all ranks; rank 0 compares them with the file and counts the
    optimizer-state values in it (0-d tensors, Adam's ``step``, not counted)."""
    full = full_parameters(model)
    if rank != 0:
        del full
        return {}
    # Memory-mapped: the check runs outside the measured windows, but need not hold a second copy of the file.
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    state = checkpoint["state_dict"]
    mismatched = sorted(k for k in full if k not in state or not torch.equal(state[k], full[k]))
    extra = sorted(k for k in state if k not in full)
    return {
        "checked_tensors": len(full),
        "mismatched": mismatched,
        "unexpected": extra,
        "ok": not mismatched and not extra,
        "parameters": sum(t.numel() for t in full.values()),
        "optimizer_state_values": sum(t.numel() for _, t in iter_tensors(checkpoint["optimizer_states"]) if t.dim()),
    }


def check_saved_file(model: torch.nn.Module, path: Path, rank: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Collective: :func:`compare_with_file`, plus whether the optimizer state is whole. Only configurations whose
    checkpoint should be complete fail for a partial one; 1.6.5's rank-0 shard is reported, not failed."""
    check = compare_with_file(model, path, rank)
    if rank == 0:
        expected = check["parameters"] * STATE_SLOTS[args.optimizer]
        check["optimizer_state_expected"] = expected
        check["optimizer_state_complete"] = check["optimizer_state_values"] == expected
        if by_name(args.config).complete:
            check["ok"] = check["ok"] and check["optimizer_state_complete"]
    return check


def verify_streamed_file(trainer: Trainer, path: Path, rank: int) -> Dict[str, Any]:
    """Collective: save again with the gathered path (unmeasured) and compare every tensor with the streamed file."""
    gathered = path.with_suffix(".gathered.ckpt")
    strategy = trainer.strategy
    strategy.stream_checkpoint = False
    try:
        trainer.save_checkpoint(gathered)
    finally:
        strategy.stream_checkpoint = True
    strategy.barrier("after-gathered-save")
    check: Dict[str, Any] = {}
    if rank == 0:
        # Memory-mapped, so the comparison holds no extra copy of either file.
        files = [torch.load(p, map_location="cpu", mmap=True, weights_only=False) for p in (path, gathered)]
        check = compare_tensors(*({k: f[k] for k in ("state_dict", "optimizer_states")} for f in files))
        del files
        gathered.unlink()
    strategy.barrier("after-stream-check")
    return check


class ResumeProbe(Callback):
    """Starts the measurement when the strategy begins reading the checkpoint; stops it at ``on_train_start``. Counts
    what the strategy's loads of the model and optimizer state read of the checkpoint's tensors, pass through
    collectives and gather (:class:`~fsdp_harness.checkpoint_reads.LoadTraffic`)."""

    def __init__(self, cuda: bool, server: Optional[ServerTraffic] = None) -> None:
        self.meter = PeakMemory()
        self.traffic = LoadTraffic()
        self.cuda = cuda
        self.server = server
        self.result: Dict[str, Any] = {}
        self._crc_before = 0.0
        self._server_before: Dict[str, Any] = {}

    def setup(self, trainer: Trainer, pl_module: Any, stage: Any = None) -> None:
        # ``setup`` runs before any restore; wrap this strategy instance's ``load_checkpoint`` only.
        strategy = trainer.strategy
        if self.cuda:
            self.meter.cuda_device = strategy.root_device
        original = strategy.load_checkpoint
        meter = self.meter

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if not meter.running:
                if self.server is not None:
                    # outside the memory window: the proxy's answer is a small JSON document
                    self._server_before = self.server.snapshot()
                meter.start()
                self._crc_before = checkpoint_io_meter.crc_seconds()
            return original(*args, **kwargs)

        strategy.load_checkpoint = load_checkpoint
        self.traffic.install(strategy)

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if self.meter.running:
            crc = checkpoint_io_meter.crc_seconds() - self._crc_before
            self.result = {**self.meter.stop(), **self.traffic.result(), "crc_seconds": crc}
            if self.server is not None:
                self.result.update(self.server.since(self._server_before))
        trainer.should_stop = True


class SaveProbe(Callback):
    """The measured save: ``trainer.save_checkpoint(path)`` on all ranks, in :class:`PeakMemory`, once, after fit.

    ``in_fit``: at the end of fit's only epoch instead, where ``async_checkpoint=True`` writes in the background. The
    memory window (and ``seconds``) lasts until ``wait_for_checkpoint`` returns, i.e. until the file is committed, and
    covers the host copies the save allocates; ``first_stall_seconds`` is how long ``save_checkpoint`` blocked the
    training thread. A second save follows, outside the window, whose stall is ``stall_seconds``: it reuses the host
    copies of the first, as every later save in the background of a fit does."""

    def __init__(
        self, path: Union[Path, str], cuda: bool, in_fit: bool, meter: checkpoint_io_meter.CheckpointIOMeter,
        server: Optional[ServerTraffic] = None,
    ) -> None:
        self.path, self.cuda, self.in_fit, self.meter, self.server = path, cuda, in_fit, meter, server
        self.result: Dict[str, Any] = {}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self.in_fit:
            return
        first_stall = self.save(trainer)
        trainer.strategy.barrier("before-second-save")
        start = time.monotonic()
        trainer.save_checkpoint(self.path)
        self.result.update(first_stall_seconds=first_stall, stall_seconds=time.monotonic() - start)
        trainer.strategy.wait_for_checkpoint()

    def save(self, trainer: Trainer) -> float:
        """The measured save; returns how long ``save_checkpoint`` blocked."""
        strategy = trainer.strategy
        strategy.barrier("before-save")
        before = self.meter.snapshot()
        server_before = self.server.snapshot() if self.server is not None else {}
        with PeakMemory(cuda_device=strategy.root_device if self.cuda else None) as meter:
            start = time.monotonic()
            trainer.save_checkpoint(self.path)
            stall = time.monotonic() - start
            wait = getattr(strategy, "wait_for_checkpoint", None)
            if callable(wait):
                wait()
        self.result = {**meter.result(), "stall_seconds": stall, **self.meter.since(before)}
        if self.server is not None:
            self.result.update(self.server.since(server_before))
        strategy.barrier("after-save")
        return stall


def remote_traffic(args: argparse.Namespace) -> Optional[ServerTraffic]:
    """A remote configuration's :class:`ServerTraffic` (which points this rank's S3 clients at its proxy), else
    ``None``."""
    if not by_name(args.config).remote:
        return None
    if not args.ckpt_url:
        raise RuntimeError(f"{args.config} saves to object storage: it needs --ckpt-url")
    return ServerTraffic()


def warm_up_client(url: str) -> Dict[str, Any]:
    """Make this process's S3 client (s3fs, aiobotocore and botocore's S3 service model) and send one ``HeadBucket``
    through it, outside the measured windows; returns its memory and seconds, measured as a save is. fsspec caches the
    filesystem, so the strategy's saves and loads (and DCP's fsspec writer and reader) use this client."""
    import fsspec

    with PeakMemory() as meter:
        fs = fsspec.filesystem("s3")
        fs.call_s3("head_bucket", Bucket=url[len("s3://"):].split("/", 1)[0])
    return meter.result()


def download(url: str, path: Path) -> int:
    """Copy the object ``url`` into the local file ``path``; returns the object's size."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    fs.get_file(url, str(path))
    return fs.info(url)["size"]


def save_and_resume(args: argparse.Namespace) -> Dict[str, Any]:
    ckpt_dir = args.ckpt_dir or args.out
    server = remote_traffic(args)
    local = Path(ckpt_dir) / f"{args.config}-n{args.devices}.ckpt"
    # remote: the object; ``local`` is then global rank 0's download of it, for the checks
    path = args.ckpt_url if server is not None else local
    meter = checkpoint_io_meter.install(ckpt_dir, args.write_mbps)
    client_setup = warm_up_client(path) if server is not None else None
    model = make_model(args)
    cuda = args.accelerator == "gpu"
    saver = SaveProbe(path, cuda, in_fit=by_name(args.config).in_background, meter=meter, server=server)
    trainer = make_trainer(args, callbacks=[saver])
    trainer.fit(model)
    rank = trainer.global_rank
    shape = describe_run(args, rank, model, args.accelerator, args.write_mbps)
    if not saver.in_fit:
        saver.save(trainer)
    checkpoint_bytes = None
    if server is not None and rank == 0:
        checkpoint_bytes = download(path, local)
    trainer.strategy.barrier("after-download")
    save_check = check_saved_file(model, local, rank, args)
    if rank == 0 and checkpoint_bytes is None:
        checkpoint_bytes = os.path.getsize(local)
    checkpoint_mb = checkpoint_bytes / MIB if rank == 0 else None
    # A remote save is not checked against a gathered one here: that would be a second S3-sized upload per run, and
    # the test suite checks that the object equals a local save byte for byte (test_ddp_fully_sharded_object_storage).
    streams = by_name(args.config).streams and server is None
    stream_check = verify_streamed_file(trainer, local, rank) if streams else None
    trainer.strategy.barrier("after-check")
    del trainer, model

    # Resume in a fresh Trainer with a fresh model (same seeds), through the public API.
    model = make_model(args)
    probe = ResumeProbe(cuda, server)
    trainer = make_trainer(args, max_epochs=2, callbacks=[probe])
    trainer.fit(model, ckpt_path=str(path))
    if not probe.result:
        raise RuntimeError("the resume measurement never started or never stopped")
    load_check = compare_with_file(model, local, rank)
    trainer.strategy.barrier("after-resume-check")
    if server is not None and rank == 0:
        import fsspec

        # the server keeps every object in memory or in its temporary files until the invocation ends
        fsspec.filesystem("s3").rm_file(path)

    result: Dict[str, Any] = {
        **shape,
        "save": saver.result,
        "load": probe.result,
    }
    if client_setup is not None:
        result["client_setup"] = client_setup
    if rank == 0:
        result.update(
            checkpoint_mb=checkpoint_mb,
            save_check=save_check,
            load_check=load_check,
            ok=bool(save_check["ok"] and load_check["ok"] and (stream_check is None or stream_check["ok"])),
        )
        if stream_check is not None:
            result["stream_check"] = stream_check
    return result


class PeriodicSaves(Callback):
    """``trainer.save_checkpoint`` every ``every`` training steps, timing how long each blocks the training thread."""

    def __init__(self, path: Path, every: int) -> None:
        self.path, self.every = path, every
        self.stalls: List[float] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.every and trainer.global_step % self.every == 0:
            start = time.monotonic()
            trainer.save_checkpoint(self.path)
            self.stalls.append(time.monotonic() - start)


def fit_with_checkpoints(args: argparse.Namespace) -> Dict[str, Any]:
    """The wall time of a fit of ``--steps`` steps that saves every ``--every`` steps (none with 0), from
    ``Trainer.fit`` until it returns (which waits for a save still in flight), and each save's stall."""
    ckpt_dir = args.ckpt_dir or args.out
    saves = PeriodicSaves(Path(ckpt_dir) / f"{args.config}-n{args.devices}-every{args.every}.ckpt", args.every)
    seed_everything(1234, workers=True)
    model = CheckpointModel(
        args.size_mb, args.units, args.devices, optimizer=args.optimizer, batches=args.steps, width=args.width,
        heads=args.heads,
    )
    trainer = make_trainer(args, callbacks=[saves])
    start = time.monotonic()
    trainer.fit(model)
    return {
        "rank": trainer.global_rank,
        "config": args.config,
        "world_size": args.devices,
        "every": args.every,
        "steps": trainer.global_step,
        "fit_seconds": time.monotonic() - start,
        "stalls": saves.stalls,
        "lightning_file": pytorch_lightning.__file__,
    }


def dcp_save_and_resume(args: argparse.Namespace) -> Dict[str, Any]:
    from fsdp_benchmarks import dcp_peer  # torch DCP and FSDP2: only the peer's ranks need them

    return dcp_peer.dcp_save_and_resume(args, checkpoint_io_meter.install(args.ckpt_dir or args.out, args.write_mbps))


if __name__ == "__main__":
    main(
        {
            "save_and_resume": save_and_resume,
            "fit_with_checkpoints": fit_with_checkpoints,
            "dcp_save_and_resume": dcp_save_and_resume,
        },
        add_arguments,
    )
