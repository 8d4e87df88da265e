"""The converter's ``--to safetensors``: a checkpoint's model weights as the Hugging Face Hub lays them out, one tensor
at a time.

The layout is ``huggingface_hub``'s (``split_torch_state_dict_into_shards``): one ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` of at most ``max_shard_size`` each (a larger tensor gets a shard of its own) with
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``); each file is written by ``safetensors``
(``serialize_file``), with the metadata ``format: pt``.

Memory: ``safetensors`` writes a file from a pointer to every tensor's bytes. A tensor already in the target dtype
and contiguous is written straight from the memory-mapped source. The others point at a private anonymous mapping
that nothing writes into (its pages read as the kernel's zero page, no memory), and once ``safetensors`` wrote the
file, each is converted alone and written into its place, found in the file's own header. So a conversion needs at
most one converted tensor of memory beyond the source's page cache, whatever the shard size.

Signals: ``safetensors`` writes a file in one call, during which Python runs no signal handler; a ``SIGTERM`` or
``Ctrl-C`` then takes effect once the file is written (a shard of source-dtype tensors: seconds per GB).
"""
# fork-feature: fork/checkpoint-converter.patch
import ctypes
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
from tqdm import tqdm

from pytorch_lightning.utilities.checkpoint_verification import _check_record_of
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.local_file_storage import _fsync_file, _pwrite_all
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

#: the dtypes ``--dtype`` names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: huggingface_hub's default (decimal units)
DEFAULT_MAX_SHARD_SIZE = "5GB"
_FILENAME_PATTERN = "model{suffix}.safetensors"
_INDEX_NAME = "model.safetensors.index.json"


def _require_packages() -> None:
    """Raises:
    MisconfigurationException: if ``safetensors`` or ``huggingface_hub`` is missing, saying how to install them."""
    try:
        import safetensors
        from huggingface_hub import split_torch_state_dict_into_shards  # noqa: F401
    except ImportError as ex:
        raise MisconfigurationException(
            f"`--to safetensors` needs the `safetensors` and `huggingface_hub` (>= 0.26) packages ({ex.name} is"
            " missing or too old): `pip install -U safetensors huggingface_hub` (or the fork's `hub` extra)."
        ) from ex
    if not hasattr(safetensors, "TensorSpec"):
        # older releases take every tensor's bytes in memory at once
        raise MisconfigurationException(
            f"`--to safetensors` needs safetensors >= 0.8 (writing from pointers), found {safetensors.__version__}:"
            " `pip install -U safetensors`."
        )


def _parse_tie(tie: str) -> Tuple[str, str]:
    keep, sep, drop = tie.partition("=")
    if not sep or not keep or not drop or keep == drop:
        raise MisconfigurationException(f"`--tie` takes KEEP=DROP, two different names; got {tie!r}.")
    return keep, drop


def _published_weights(state_dict: Dict[str, Any], strip_prefix: str, ties: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The weights to publish: the tensors of ``state_dict`` under ``strip_prefix``, the prefix stripped (the others
    are named in one warning and left out), without the tied duplicates ``ties`` (``KEEP=DROP``, names after
    stripping) names, each dropped only where its values (and dtype) equal the kept one's. Nothing is deduplicated
    by value.

    Raises:
        MisconfigurationException: if no tensor is under the prefix, if one is sparse, if a name of ``ties`` is
            missing, or if a tied duplicate's bytes differ from the kept tensor's.
    """
    weights, left_out = {}, []
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor) or not key.startswith(strip_prefix) or key == strip_prefix:
            left_out.append(key)
            continue
        if value.layout != torch.strided:
            raise MisconfigurationException(f"{key!r} is a {value.layout} tensor; safetensors holds dense ones.")
        weights[key[len(strip_prefix) :]] = value
    if not weights:
        raise MisconfigurationException(
            f"No tensor of the checkpoint's `state_dict` is under the prefix {strip_prefix!r}; its first keys:"
            f" {', '.join(list(state_dict)[:5])}."
        )
    if left_out:
        rank_zero_warn(f"Left out (not tensors under {strip_prefix!r}): {', '.join(left_out)}.")
    for keep, drop in map(_parse_tie, ties):
        missing = [name for name in (keep, drop) if name not in weights]
        if missing:
            raise MisconfigurationException(f"`--tie {keep}={drop}`: no weight {', '.join(map(repr, missing))}.")
        if not _same_bytes(weights[keep], weights[drop]):
            raise MisconfigurationException(f"`--tie {keep}={drop}`: the two weights differ; both are kept otherwise.")
        del weights[drop]
    return weights


def _same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (``-0.0`` is not ``0.0``, a NaN equals itself), their records checked
    against their CRC-32s first."""
    _check_record_of(first)
    _check_record_of(second)
    if first.dtype != second.dtype or first.shape != second.shape:
        return False
    return torch.equal(*(t.contiguous().reshape(-1).view(torch.uint8) for t in (first, second)))


def _write_safetensors(
    weights: Dict[str, torch.Tensor], directory: Path, dtype: torch.dtype, max_shard_size: str, bar: tqdm
) -> None:
    """Write ``weights`` in ``dtype`` (the floating-point ones: integer and boolean buffers keep theirs) into
    ``directory`` in the Hub's layout (see the module's docstring), counting each tensor's bytes in the source on
    ``bar`` once written."""
    from huggingface_hub import split_torch_state_dict_into_shards

    shapes = {name: torch.empty(t.shape, dtype=_target(t, dtype), device="meta") for name, t in weights.items()}
    try:
        # a number of bytes, or huggingface_hub's units ("5GB", "500MB": decimal)
        limit = int(max_shard_size) if max_shard_size.strip().isdigit() else max_shard_size
        split = split_torch_state_dict_into_shards(shapes, filename_pattern=_FILENAME_PATTERN, max_shard_size=limit)
    except ValueError as ex:
        raise MisconfigurationException(f"`--max-shard-size {max_shard_size}`: {ex}") from ex
    overflowed: List[str] = []
    for filename, names in split.filename_to_tensors.items():
        overflowed += _write_file(directory / filename, {name: weights[name] for name in names}, dtype, bar)
    if overflowed:
        rank_zero_warn(f"Values beyond {dtype}'s range became inf in: {', '.join(overflowed)}.")
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        path = directory / _INDEX_NAME
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _fsync_file(str(path))


def _write_file(path: Path, tensors: Dict[str, torch.Tensor], dtype: torch.dtype, bar: tqdm) -> List[str]:
    """One ``.safetensors`` file of ``tensors`` in ``dtype`` (see the module's docstring); returns the names of the
    tensors in which a finite value became infinite (``float16`` holds up to 65504)."""
    from safetensors import serialize_file, TensorSpec

    targets = {name: _target(tensor, dtype) for name, tensor in tensors.items()}
    pending = [name for name, tensor in tensors.items() if tensor.dtype != targets[name] or not tensor.is_contiguous()]
    zeros_bytes = max((tensors[name].numel() * targets[name].itemsize for name in pending), default=0)
    # never written to: every page reads as the kernel's zero page, which takes no memory
    zeros = mmap.mmap(-1, max(zeros_bytes, 1), flags=mmap.MAP_PRIVATE)
    zeros_ptr = ctypes.addressof(ctypes.c_char.from_buffer(zeros))
    try:
        specs = {}
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * targets[name].itemsize
            if name in pending:
                pointer = zeros_ptr
            else:
                _check_record_of(tensor)  # a corrupt source record fails before its bytes are written
                pointer = tensor.data_ptr()
            specs[name] = TensorSpec(
                dtype=str(targets[name]).split(".")[-1], shape=list(tensor.shape), data_ptr=pointer, data_len=nbytes
            )
        serialize_file(specs, str(path), metadata={"format": "pt"})
        del specs
    finally:
        zeros.close()
    bar.update(sum(tensors[name].nbytes for name in tensors if name not in pending))
    overflowed = []
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        base = 8 + length
        for name in pending:
            tensor = tensors[name]
            _check_record_of(tensor)
            # one buffer: ``.to`` keeps a non-contiguous tensor's strides, and ``.contiguous()`` would copy it again
            converted = torch.empty(tensor.shape, dtype=targets[name])
            converted.copy_(tensor)
            if converted.is_floating_point() and bool(torch.isinf(converted).any()) and not torch.isinf(tensor).any():
                overflowed.append(name)
            begin, end = header[name]["data_offsets"]
            assert end - begin == converted.nbytes, (name, begin, end, converted.nbytes)
            _pwrite_all(f.fileno(), converted.reshape(-1).view(torch.uint8).numpy(), base + begin)
            del converted
            bar.update(tensor.nbytes)
        os.fsync(f.fileno())
    return overflowed


def _target(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``tensor`` is published in: ``dtype`` for floating-point weights, its own for the others (a step
    count, a mask)."""
    return dtype if tensor.is_floating_point() else tensor.dtype
