"""The torch DCP peer of the checkpoint-memory benchmark: one rank of ``python -m fsdp_benchmarks.worker
dcp_save_and_resume ...``, started once per rank by the runner (:func:`fsdp_harness.multiprocess.run_tasks`, with
``RANK``/``WORLD_SIZE``/``MASTER_*`` in each environment), not by Lightning: no Lightning strategy is involved.

Every rank:

1. builds the benchmark's model (:class:`fsdp_benchmarks.model.CheckpointModel`: same seed, K blocks of
   ``Linear(w, w)``, and the heads where it has them), shards it with torch FSDP2 (``fully_shard`` on each block and
   head, then on the root) on CPU over gloo,
   and trains it for the same number of steps with the same optimizer (SGD momentum, or Adam), so the optimizer
   has state;
2. **save**: ``get_state_dict(model, optimizer)`` and ``dcp.save({"model", "optim"})`` into a directory, measured by
   :class:`~fsdp_harness.memory_sampler.PeakMemory` as the fork's saves are, with the bytes this rank wrote to the
   directory (:mod:`fsdp_benchmarks.checkpoint_io_meter`: DCP writes one ``__<rank>_*.distcp`` file per rank, and
   rank 0 the ``.metadata`` file);
3. **resume**: a fresh sharded model and optimizer (no state yet, baseline taken there), then, measured, the
   templates (``get_state_dict``, which creates the optimizer's state), ``dcp.load`` into them and ``set_state_dict``,
   with the bytes this rank's file reads returned;
4. checks every tensor of its shards of the model and optimizer state after the load against those before the
   save, bit for bit, and counts the optimizer-state values over all ranks against a full state.

So it is measured exactly like the fork's configurations, but its checkpoint is a directory (one file per rank plus
metadata), not one ``torch.save`` file.

A remote configuration (``dcp-fsspec-s3``) saves into the directory ``--ckpt-url`` (``s3://...``) through torch's
``FsspecWriter`` and loads through its ``FsspecReader`` (s3fs underneath, one object per rank plus ``.metadata``),
each rank through its own proxy, which counts the bytes it sends to and receives from the server in the measured
save and load (:class:`fsdp_benchmarks.worker.ServerTraffic`), with its S3 client made before, as the fork's ranks
make theirs (:func:`fsdp_benchmarks.worker.warm_up_client`). The sizes are then those of the objects.
"""
import argparse
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_benchmarks.checkpoint_io_meter import CheckpointIOMeter
from fsdp_benchmarks.model import STATE_SLOTS, CheckpointModel
from fsdp_benchmarks.worker import ServerTraffic, describe_run, remote_traffic, warm_up_client
from fsdp_harness.memory_sampler import MIB, PeakMemory
from fsdp_harness.tensor_compare import compare_tensors, iter_tensors
from pytorch_lightning import seed_everything
from pytorch_lightning.utilities.apply_func import apply_to_collection

#: training steps before the save: the batches of the fork configurations' one epoch (``CheckpointModel``'s default)
STEPS = 2


def _sharded(args: argparse.Namespace) -> Tuple[nn.Module, torch.optim.Optimizer]:
    seed_everything(1234, workers=True)
    model = CheckpointModel(
        args.size_mb, args.units, args.devices, optimizer=args.optimizer, width=args.width, heads=args.heads
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layer:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model.configure_optimizers()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # Each rank its own batches, as Lightning's DistributedSampler gives the fork's ranks theirs.
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(STEPS):
        batch = torch.randn(2, model.width, generator=generator)
        prediction = model(batch)
        nn.functional.mse_loss(prediction, torch.ones_like(prediction)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _local(state: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's shards as plain tensors, copied (the optimizer's ``step`` tensors change in place)."""
    state = apply_to_collection(state, DTensor, lambda t: t.to_local())
    return apply_to_collection(state, torch.Tensor, lambda t: t.detach().clone())


def _files_of(directory: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in directory.glob(f"__{rank}_*.distcp"))


class _Remote:
    """The checkpoint's directory of objects: DCP's fsspec writer and reader of it, and its objects' sizes."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs = fsspec.filesystem("s3")

    def writer(self) -> Any:
        # not exported by torch.distributed.checkpoint in every torch version: its own module has it
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.url)

    def reader(self) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.url)

    def sizes(self) -> Dict[str, int]:
        self.fs.invalidate_cache()
        return {path.rsplit("/", 1)[1]: info["size"] for path, info in self.fs.find(self.url, detail=True).items()}

    def remove(self) -> None:
        if self.fs.exists(self.url):
            self.fs.rm(self.url, recursive=True)


def dcp_save_and_resume(args: argparse.Namespace, meter: CheckpointIOMeter) -> Dict[str, Any]:
    server: Optional[ServerTraffic] = remote_traffic(args)  # before any S3 client: it picks this rank's proxy
    client_setup = warm_up_client(args.ckpt_url) if server is not None else None  # as the fork's ranks do
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory = Path(args.ckpt_dir or args.out) / f"{args.config}-n{args.devices}.dcp"
    remote = _Remote(args.ckpt_url) if server is not None else None
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        if remote is not None:
            remote.remove()
    dist.barrier()
    model, optimizer = _sharded(args)
    shape = describe_run(args, rank, model, "cpu", meter.write_mbps)
    _train(model, optimizer)

    dist.barrier()
    before = meter.snapshot()
    server_before = server.snapshot() if server is not None else {}
    with PeakMemory() as save_meter:
        if remote is not None:
            dcp.save(_state(model, optimizer), storage_writer=remote.writer())
        else:
            dcp.save(_state(model, optimizer), checkpoint_id=str(directory))
    save = {**save_meter.result(), **meter.since(before)}
    if server is not None:
        save.update(server.since(server_before))
    dist.barrier()
    # cross-check of the meter (remote: of the proxy's count): the sizes of this rank's own files
    if remote is not None:
        save["files_bytes"] = sum(size for name, size in remote.sizes().items() if name.startswith(f"__{rank}_"))
    else:
        save["files_bytes"] = _files_of(directory, rank)
    expected = _local(_state(model, optimizer))
    parameters = sum(p.numel() for p in model.parameters())  # DTensor: the full parameter's count
    del model, optimizer

    model, optimizer = _sharded(args)
    dist.barrier()
    before = meter.snapshot()
    server_before = server.snapshot() if server is not None else {}
    with PeakMemory() as load_meter:
        state = _state(model, optimizer)
        if remote is not None:
            dcp.load(state, storage_reader=remote.reader())
        else:
            dcp.load(state, checkpoint_id=str(directory))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        del state
    load = {**load_meter.result(), "bytes_read": meter.snapshot()["bytes_read"] - before["bytes_read"]}
    if server is not None:
        load.update(server.since(server_before))
    dist.barrier()

    check = compare_tensors(expected, _local(_state(model, optimizer)))
    local_values = sum(t.numel() for _, t in iter_tensors(expected["optim"]) if t.dim())
    totals = torch.tensor([local_values, len(check["mismatched"]), check["compared"]], dtype=torch.int64)
    dist.all_reduce(totals)
    mismatched = [None] * dist.get_world_size()
    dist.all_gather_object(mismatched, [f"rank {rank}: {path}" for path in check["mismatched"]])
    result: Dict[str, Any] = {
        **shape,
        "save": save,
        "load": load,
    }
    if client_setup is not None:
        result["client_setup"] = client_setup
    if rank == 0:
        optimizer_values = int(totals[0])
        expected_values = parameters * STATE_SLOTS[args.optimizer]
        mismatches = [path for paths in mismatched for path in paths]
        tensor_check = {"compared": int(totals[2]), "mismatched": mismatches, "ok": not mismatches}
        sizes = remote.sizes().values() if remote is not None else [p.stat().st_size for p in directory.iterdir()]
        result.update(
            checkpoint_mb=sum(sizes) / MIB,
            save_check={
                "mismatched": [], "optimizer_state_values": optimizer_values,
                "optimizer_state_expected": expected_values,
                "optimizer_state_complete": optimizer_values == expected_values,
            },
            load_check={"mismatched": mismatches},
            tensor_check=tensor_check,
            ok=bool(tensor_check["ok"] and optimizer_values == expected_values),
        )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        if remote is not None:
            remote.remove()  # the server keeps every object until the invocation ends
    return result
