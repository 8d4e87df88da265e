"""Which storage (:mod:`~pytorch_lightning.utilities.checkpoint_storage`) a checkpoint path takes: local files,
multipart objects (S3 through s3fs) or sequential streams (any other ``fsspec`` filesystem); and global rank 0's
scratch file, where a checkpoint goes to object storage.
"""
# fork-feature: fork/object-storage-checkpoints.patch
import os
import tempfile
from typing import Any, Optional

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pytorch_lightning.utilities.checkpoint_location import _prepare_checkpoint_dir
from pytorch_lightning.utilities.checkpoint_storage import _CheckpointStorage
from pytorch_lightning.utilities.multipart_upload import _is_multipart_store
from pytorch_lightning.utilities.object_storage import _MultipartObjectStorage, _SequentialStreamStorage
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile
from pytorch_lightning.utilities.types import _PATH

#: The directory of global rank 0's scratch files, under the system's temporary directory.
SCRATCH_DIRECTORY = "pl-checkpoint-scratch"


def _storage_kind(path: _PATH) -> str:
    """``"local"``, ``"multipart"`` or ``"sequential"`` (see :mod:`~pytorch_lightning.utilities.checkpoint_storage`)
    for the checkpoint path ``path``.

    Raises:
        ValueError: if ``fsspec`` knows no filesystem for its protocol (or its package is not installed).
    """
    fs, _ = url_to_fs(str(path))
    if isinstance(fs, LocalFileSystem):
        return "local"
    return "multipart" if _is_multipart_store(fs) else "sequential"


def _storage_for_reading(url: str, etag: Optional[str] = None) -> _CheckpointStorage:
    """The storage that reads the object at ``url`` (not a local path), at version ``etag`` where given (S3)."""
    fs, _ = url_to_fs(url)
    if _is_multipart_store(fs):
        return _MultipartObjectStorage(url, etag=etag)
    return _SequentialStreamStorage(url)


def _scratch_checkpoint_file(filepath: _PATH) -> _StreamedCheckpointFile:
    """Global rank 0's scratch file for a checkpoint going to ``filepath`` in object storage: a temporary file named
    as a local save's (``<name>.<host id>.<pid>.<8 hex digits>.tmp``) in ``pl-checkpoint-scratch`` under the system's
    temporary directory (``TMPDIR``), whose stale files (those of killed saves) every new one removes, as a local save
    does beside its file. Its storage is set once the save knows it (see :func:`_stage_for_sequential_copy`)."""
    directory = os.path.join(tempfile.gettempdir(), SCRATCH_DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    return _StreamedCheckpointFile(filepath, directory=directory)


def _stage_for_sequential_copy(strategy: Any, stream: Any, writer: _StreamedCheckpointFile) -> None:
    """On global rank 0, once it wrote the structure into its scratch ``writer``: check the destination's bucket
    (never created) or make its directory, and give the writer the sequential stream its commit copies the file into
    (the ``plan_units`` of the streamed save; ``strategy`` and ``stream`` are not needed)."""
    fs, _ = url_to_fs(writer.path)
    _prepare_checkpoint_dir(fs, writer.path)
    writer.storage = _SequentialStreamStorage(writer.path, writer.tmp_path)
