"""Memory-mapped checkpoint loads: when every process on a machine loads the same local checkpoint, as all ranks do
on resume, they share its pages in the page cache instead of each holding a full copy.

The hook is :func:`pytorch_lightning.utilities.cloud_io.load` (its ``mmap`` argument), which
``TorchCheckpointIO.load_checkpoint`` calls with ``mmap=True``.
"""
# fork-feature: fork/mmap-checkpoint-load.patch
import inspect
import os

import torch
from fsspec.implementations.local import AbstractFileSystem, LocalFileSystem

# ``torch.load(mmap=True)`` exists since torch 2.1.
_TORCH_LOAD_MMAP_AVAILABLE = "mmap" in inspect.signature(torch.load).parameters


def _can_mmap(fs: AbstractFileSystem, path: str) -> bool:
    """Whether ``torch.load(path, mmap=True)`` applies: a local file in torch's zip format, mapped privately."""
    if not _TORCH_LOAD_MMAP_AVAILABLE or not isinstance(fs, LocalFileSystem):
        return False
    if os.name == "nt":
        # Windows cannot replace or rewrite a file while it is mapped, so saving over the checkpoint that training
        # resumed from (``last.ckpt``) would fail as long as restored tensors still map it
        return False
    get_mmap_flags = getattr(torch.serialization, "get_default_mmap_options", None)
    if get_mmap_flags is not None:
        import mmap

        # with ``MAP_SHARED`` (a global torch setting) in-place updates of loaded tensors would write to the file
        if get_mmap_flags() != getattr(mmap, "MAP_PRIVATE", None):
            return False
    with fs.open(path, "rb") as f:
        # torch's zip format (``_use_new_zipfile_serialization=True``) starts with a local file header
        return f.read(4) == b"PK\x03\x04"
