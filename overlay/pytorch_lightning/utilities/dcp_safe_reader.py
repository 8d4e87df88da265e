"""Reading a torch Distributed Checkpoint (DCP) directory without running code from it (the converter's
``--from dcp``).

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load``, and its
``DefaultLoadPlanner.load_bytes`` every non-tensor entry (``param_groups``' hyperparameters, names) with
``torch.load(weights_only=False)``: a directory from elsewhere runs whatever its pickles name. Here
:class:`_SafeFileSystemReader` unpickles ``.metadata`` with a ``find_class`` allow-list of exactly the globals DCP's
metadata needs (:data:`METADATA_GLOBALS`, measured on torch 2.13, plus the names older torch and Python 3.13 pickle
the same classes under), and :class:`_SafeLoadPlanner` loads the non-tensor
entries with ``torch.load(weights_only=True)``. A file that needs anything else is refused before its payload runs.
"""
# fork-feature: fork/checkpoint-converter.patch
import io
import os
import pathlib
import pickle
from typing import Any, FrozenSet, Optional, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from pytorch_lightning.utilities.exceptions import MisconfigurationException

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: the globals a ``.metadata`` of ``dcp.save`` names
METADATA_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset(
    {
        ("pathlib", "PosixPath"),
        # Python 3.13's pathlib is a package: its paths pickle under ``pathlib._local``
        ("pathlib._local", "PosixPath"),
        ("torch", "Size"),
        # torch < 2.2 pickled ``TensorProperties`` (and its memory format) from the sharded tensor's module
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        # the dtypes
        *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)),
    }
)


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise _RefusedGlobal(f"{module}.{name}")
        if module == "pathlib._local" and not hasattr(pathlib, "_local"):
            # written by Python 3.13, read by an older one
            module = "pathlib"
        return super().find_class(module, name)


class _SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with :data:`METADATA_GLOBALS` only, once: every
    ``dcp.load`` through the reader asks for it again."""

    _metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = self._metadata if rank is None else None
        if metadata is None:
            metadata = self._read_metadata(self._get_metadata_path(rank))
            if rank is None:
                self._metadata = metadata
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata(self, path: Any) -> Metadata:
        with self.fs.create_stream(path, "rb") as metadata_file:
            try:
                metadata = _MetadataUnpickler(metadata_file).load()
            except _RefusedGlobal as ex:
                raise MisconfigurationException(
                    f"{path} names `{ex}`, which a DCP checkpoint's metadata never needs: refused, nothing of it ran."
                ) from None
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as ex:
                raise MisconfigurationException(
                    f"{path} cannot be read as a DCP checkpoint's metadata: {type(ex).__name__}: {ex}"
                ) from None
        if not isinstance(metadata, Metadata):
            raise MisconfigurationException(f"{path} is not a DCP checkpoint's metadata ({type(metadata).__name__}).")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        for name in {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}:
            # DCP writes its data files beside ``.metadata`` under plain names: any other path, or a symbolic link,
            # would have the reader copy a file from elsewhere on the machine into the converted checkpoint
            plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            if not plain or os.path.islink(os.path.join(str(self.path), name)):
                raise MisconfigurationException(
                    f"{path} points at the data file {name!r}, outside its directory or a symbolic link: refused."
                )
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads the non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as ex:
            raise MisconfigurationException(
                f"The DCP entry {read_item.dest_index.fqn!r} needs more than tensors and plain values to load:"
                f" refused, nothing of it ran ({' '.join(str(ex).split())[:200]})."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
