"""The parallel FSDP load from object storage (any ``fsspec`` filesystem but the local one): every rank fetches,
with ranged reads (S3's ranged GETs), only the bytes it reads.

The local load maps the file and every rank copies the elements of its own shards out of the full tensors (see
:mod:`.fsdp_restore`, :mod:`.fsdp_portable_optimizer_state`). From an object in S3, each rank instead builds a sparse
local copy of it (:mod:`~pytorch_lightning.utilities.sparse_object_copy`), through its storage's ranged reads
(:mod:`~pytorch_lightning.utilities.checkpoint_storage`):

1. the zip's structure (central directory, local headers, ``data.pkl`` and the version records), from which
   ``torch.load(map_location="meta")`` gives every tensor's place in the file without reading any tensor;
2. for each FSDP flat parameter of the sharded model, the byte ranges of this rank's shard in the records of the
   original parameters it holds, and the same ranges of their optimizer state (the portable layout keeps one state
   tensor per parameter, of the parameter's shape); every other tensor record (parameters outside FSDP, tied names'
   own records, scalar state) whole.

Every rank reads the same version of the object: global rank 0 looks up its size and ETag and sends them to the
others, and on S3 every ranged GET carries ``If-Match`` with that ETag, so an object replaced during the load (a
``last.ckpt`` rewritten by a training job while another job loads it) fails the load instead of mixing two
checkpoints. On S3, global rank 0 first aborts the uploads into the object's directory that killed jobs left (see
:mod:`~pytorch_lightning.utilities.stale_uploads`).

The checkpoint is then loaded from the copy, memory-mapped, as a local one is, and its CRC-32 check reads the copy: a
read of bytes that were never fetched raises instead of going on with zeros. No rank downloads the whole object,
except at a world size of 1, where the one rank reads every byte, and where the LightningModule or the
LightningDataModule overrides ``on_load_checkpoint``, which may read any tensor whole: then every rank fetches the
whole object, with an info line that says so.

The hook is ``DDPFullyShardedStrategy.load_checkpoint`` (the fork's override), through the checkpointer.
"""
# fork-feature: fork/object-storage-checkpoints.patch
from typing import Any, Dict, List, Optional, Tuple, TYPE_CHECKING

import torch

from pytorch_lightning.plugins.io.torch_plugin import TorchCheckpointIO
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.strategies.fsdp_introspection import _flat_parameter_keys, _named_fsdp_instances, _shard_range
from pytorch_lightning.utilities.checkpoint_crc import _ZipIndex
from pytorch_lightning.utilities.checkpoint_errors import _broadcast_failure, _distributed_run
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.checkpoint_storage_kinds import _storage_for_reading, _storage_kind
from pytorch_lightning.utilities.checkpoint_verification import _hand_local_copy_to_check, _tensors_of
from pytorch_lightning.utilities.cloud_io import get_filesystem
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.model_helpers import is_overridden
from pytorch_lightning.utilities.multipart_upload import _is_multipart_store
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from pytorch_lightning.utilities.sparse_object_copy import _SparseObjectCopy
from pytorch_lightning.utilities.stale_uploads import _abort_stale_uploads
from pytorch_lightning.utilities.types import _PATH

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

_Range = Tuple[int, int]


def _load_checkpoint_in_ranges(strategy: "DDPFullyShardedStrategy", path: _PATH) -> Optional[Dict[str, Any]]:
    """The checkpoint at ``path`` loaded from the bytes this rank reads (see the module's docstring); ``None`` where
    this does not apply (a local file, or a custom ``CheckpointIO.load_checkpoint``): the caller loads it as
    before.

    Raises:
        FileNotFoundError: if there is no object at ``path``.
    """
    load = getattr(strategy.checkpoint_io, "load_checkpoint", None)
    if _storage_kind(path) == "local" or getattr(load, "__func__", None) is not TorchCheckpointIO.load_checkpoint:
        return None
    fs = get_filesystem(path)
    url = str(path)
    size, etag = _object_version(strategy, fs, url)
    copy = _SparseObjectCopy(_storage_for_reading(url, etag), size)
    try:
        index = copy.fetch_structure()
        trainer = strategy.lightning_module.trainer
        hooks = [strategy.lightning_module, getattr(trainer, "datamodule", None)]
        if any(hook is not None and is_overridden("on_load_checkpoint", hook) for hook in hooks):
            rank_zero_info(
                f"Every rank downloads the whole checkpoint {_redacted(url)}, not only its own shards: the"
                " LightningModule's or LightningDataModule's `on_load_checkpoint` may read any of its tensors."
            )
            copy.fetch([(0, copy.size)])
        else:
            structure = pl_load(copy.path, map_location="meta")
            copy.fetch(_ranges_read(strategy, structure, index))
            del structure
        checkpoint = pl_load(copy.path, map_location=lambda storage, loc: storage, mmap=True)
    except BaseException:
        copy.close()
        raise
    _hand_local_copy_to_check(url, copy)
    return checkpoint


def _object_version(strategy: "DDPFullyShardedStrategy", fs: Any, url: str) -> Tuple[int, Optional[str]]:
    """The size and ETag (``None`` where the filesystem gives none) of the object at ``url``, as global rank 0 finds
    them, on every rank. Collective where several processes run.

    Raises:
        FileNotFoundError: on every rank, if there is no object at ``url``.
        OSError: on every rank, if global rank 0 could not look it up.
    """
    found: Tuple[Any, ...] = ()
    error: Optional[BaseException] = None
    if strategy.is_global_zero:
        try:
            if _is_multipart_store(fs):
                # as a local load removes the temporary files of killed saves beside the file; before the broadcast,
                # so that its failure (an invalid `PL_CHECKPOINT_STALE_UPLOAD_AGE`) reaches every rank
                _abort_stale_uploads(fs, url.rsplit("/", 1)[0])
            found = _SparseObjectCopy.version_of(fs, url)
        except Exception as ex:
            # the type only: an error's text may quote the URL with its secret
            error, found = ex, ("failed", isinstance(ex, FileNotFoundError), type(ex).__name__)
    if _distributed_run(strategy.world_size) and torch.distributed.is_initialized():
        found = _broadcast_failure(strategy, found, src=0)
    if found and found[0] == "failed":
        if found[1]:
            raise FileNotFoundError(f"Checkpoint at {_redacted(url)} not found. Aborting training.")
        if error is not None:
            raise error
        raise OSError(f"Global rank 0 could not prepare the load of {_redacted(url)} ({found[2]}).")
    return found


def _ranges_read(strategy: "DDPFullyShardedStrategy", checkpoint: Dict[str, Any], index: _ZipIndex) -> List[_Range]:
    """The byte ranges of the file of ``index`` that this rank reads when it loads ``checkpoint`` (loaded onto the
    meta device: each tensor's storage knows its ``_checkpoint_offset``) into the sharded model; a tensor record that
    no dense tensor of the checkpoint lies in (a sparse tensor's) is read whole. The optimizer state is read only
    where the optimizers are restored (``fit``; not ``validate``, ``test`` or ``predict``)."""
    shards = _shard_elements(strategy, checkpoint)
    fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
    ranges = []
    bases = set()
    for key, tensor in _tensors_of(checkpoint, ""):
        if not fitting and key.split(".", 1)[0] == "optimizer_states":
            bases.add(getattr(tensor.untyped_storage(), "_checkpoint_offset", None))
            continue
        storage = tensor.untyped_storage()
        base = getattr(storage, "_checkpoint_offset", None)
        if base is None:
            raise RuntimeError("this torch does not report where a tensor's data lies in the file")
        bases.add(base)
        elements = shards.get(id(tensor))
        if elements is None or not tensor.is_contiguous():
            ranges.append((base, base + storage.nbytes()))
        else:
            itemsize = tensor.element_size()
            lo, hi = (tensor.storage_offset() + i for i in elements)
            ranges.append((base + lo * itemsize, base + hi * itemsize))
    ranges += [(r.offset, r.offset + r.size) for r in index.records if r.is_tensor and r.offset not in bases]
    return ranges


def _shard_elements(strategy: "DDPFullyShardedStrategy", checkpoint: Dict[str, Any]) -> Dict[int, Tuple[int, int]]:
    """For each tensor of ``checkpoint`` that this rank reads only a part of (by ``id``), the elements it reads: its
    shard's part of each original parameter of an FSDP flat parameter (as ``_copy_flat_slice`` reads it), and the
    same part of the parameter's optimizer state in the portable layout (``param_names``)."""
    state_dict = checkpoint.get("state_dict") or {}
    optimizer_states = [s for s in checkpoint.get("optimizer_states") or [] if isinstance(s, dict)]
    states_by_name = [
        {name: s.get("state", {}).get(i, {}) for i, name in enumerate(s.get("param_names") or [])}
        for s in optimizer_states
    ]
    elements: Dict[int, Tuple[int, int]] = {}
    for prefix, instance in _named_fsdp_instances(strategy.lightning_module):
        for flat in instance.params:
            pieces, _ = _flat_parameter_keys(prefix, instance, flat)
            if not all(isinstance(state_dict.get(key), torch.Tensor) for key, _ in pieces):
                continue  # the load fails on the missing keys, reading nothing of the others
            tensors = [state_dict[key] for key, _ in pieces]
            _, start, end = _shard_range(sum(t.numel() for t in tensors), instance.rank, instance.world_size)
            offset = 0
            for (key, _), tensor in zip(pieces, tensors):
                part = (max(start - offset, 0), max(min(end - offset, tensor.numel()), 0))
                offset += tensor.numel()
                part = part if part[0] < part[1] else (0, 0)
                elements[id(tensor)] = part
                for states in states_by_name:
                    for value in states.get(key, {}).values():
                        if isinstance(value, torch.Tensor) and value.numel() == tensor.numel() > 1:
                            elements[id(value)] = part
    return elements
