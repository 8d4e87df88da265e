"""Upstream 1.6.5's checkpoint I/O on the fork's build, for the benchmark's ``rank0-only`` configuration.

The fork's ``TorchCheckpointIO`` streams saves into a temporary file and memory-maps local files on load. To show the
upstream PR with upstream's I/O on the fork's build, ``rank0-only`` plugs in this ``CheckpointIO``, which does what
1.6.5 did (the ``upstream`` configurations run 1.6.5 itself and need none): serialise the whole checkpoint into an
in-memory buffer, write that buffer out in one go, and read files back with a plain ``torch.load`` into private memory.
"""
import inspect
import io
from typing import Any, Callable, Dict, Optional

import fsspec
import torch

from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.types import _PATH


class UpstreamCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        with fsspec.open(str(path), "wb") as f:
            f.write(buffer.getvalue())  # ``getvalue`` is a second full copy, as upstream's was

    def load_checkpoint(self, path: _PATH, map_location: Optional[Callable] = lambda storage, loc: storage) -> Any:
        # ``mmap`` exists only with the fork/mmap-checkpoint-load patch; without it the load is plain already
        plain = {"mmap": False} if "mmap" in inspect.signature(pl_load).parameters else {}
        return pl_load(path, map_location=map_location, **plain)
