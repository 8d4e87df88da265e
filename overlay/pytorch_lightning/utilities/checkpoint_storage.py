"""The three kinds of storage a streamed checkpoint goes to, and where its bytes go when it is committed.

- **Local files** (``"local"``; anything mounted, NFS and Lustre included): the streamed file is written in place,
  as a temporary file beside the checkpoint that its commit renames over it (see
  :class:`~pytorch_lightning.utilities.streamed_checkpoint_file._StreamedCheckpointFile`).
- **Multipart objects** (``"multipart"``: S3 and S3-compatible stores, through s3fs): every rank uploads its parts of
  one object (:mod:`~pytorch_lightning.strategies.fsdp_parallel_upload`); global rank 0 builds the structure in a
  sparse local scratch file, and its commit completes the multipart upload (:class:`_MultipartDestination`).
- **Sequential streams** (``"sequential"``: any other ``fsspec`` filesystem, such as ``gs://`` through gcsfs or
  ``az://`` through adlfs, and S3 with ``checkpoint_writers="rank0"``, through s3fs's own upload): global rank 0
  writes the streamed save into a local scratch file, unit by unit as locally, and its commit copies the file into
  the destination in file order, in one write stream closed only once the copy is complete
  (:class:`_SequentialDestination`): the object appears at that close, where the filesystem's upload defers it
  (gcsfs's, adlfs's and s3fs's do). The data are staged through the local file, so rank 0 holds about one
  unit in memory, as locally.

Every rank reads from any of them by ranges (:mod:`~pytorch_lightning.strategies.fsdp_ranged_load`).
"""
# fork-feature: fork/object-storage-checkpoints.patch
import logging
import os
import shutil
import tempfile
from typing import Any, List

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from pytorch_lightning.utilities.checkpoint_location import _prepare_checkpoint_dir, _redacted
from pytorch_lightning.utilities.multipart_upload import _is_multipart_store, _MultipartUpload, _UploadedPart
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile
from pytorch_lightning.utilities.types import _PATH

log = logging.getLogger(__name__)

#: The directory of global rank 0's scratch files, under the system's temporary directory.
SCRATCH_DIRECTORY = "pl-checkpoint-scratch"
#: How many bytes of the scratch file a sequential destination copies at a time.
_COPY_BYTES = 16 * 2**20


def _storage_kind(path: _PATH) -> str:
    """``"local"``, ``"multipart"`` or ``"sequential"`` (see the module's docstring) for the checkpoint path ``path``.

    Raises:
        ValueError: if ``fsspec`` knows no filesystem for its protocol (or its package is not installed).
    """
    fs, _ = url_to_fs(str(path))
    if isinstance(fs, LocalFileSystem):
        return "local"
    return "multipart" if _is_multipart_store(fs) else "sequential"


def _scratch_checkpoint_file(filepath: _PATH) -> _StreamedCheckpointFile:
    """Global rank 0's scratch file for a checkpoint going to ``filepath`` in object storage: a temporary file named
    as a local save's (``<name>.<host id>.<pid>.<8 hex digits>.tmp``) in ``pl-checkpoint-scratch`` under the system's
    temporary directory (``TMPDIR``), whose stale files (those of killed saves) every new one removes, as a local save
    does beside its file."""
    directory = os.path.join(tempfile.gettempdir(), SCRATCH_DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    return _StreamedCheckpointFile(filepath, directory=directory)


class _MultipartDestination:
    """Where global rank 0's scratch file goes on S3: :meth:`publish` completes the multipart ``upload`` with every
    rank's parts (set in :attr:`parts` once they all succeeded), :meth:`abandon` aborts it."""

    def __init__(self, fs: AbstractFileSystem, upload: _MultipartUpload) -> None:
        self.fs, self.upload = fs, upload
        self.parts: List[_UploadedPart] = []

    def publish(self, scratch_path: str) -> None:
        self.upload.complete(self.fs, self.parts)

    def abandon(self) -> None:
        # the save's own failure is what the user needs to see; a failed abort leaves an incomplete upload, which the
        # next save into the directory or a bucket lifecycle rule removes (see docs/faults.md)
        try:
            self.upload.abort(self.fs)
        except Exception as ex:
            log.warning(f"Could not abort {self.upload} ({type(ex).__name__}); the next save into its directory will.")


class _SequentialDestination:
    """Where global rank 0's scratch file goes on a filesystem without the fork's multipart uploads: :meth:`publish`
    copies it into ``path`` on ``fs`` through one file opened for writing, in blocks of :data:`_COPY_BYTES`, and
    closes that file only once the whole copy is written: an object store's upload (s3fs's, gcsfs's, adlfs's)
    makes the object appear at that close, and a copy that fails is discarded instead (``discard()``, which aborts
    the upload), never closed. (An ``fsspec`` transaction would do the same, but s3fs then holds the file's blocks in
    memory until it ends: 240 MiB for a 288 MiB file, measured, against 48 MiB.)"""

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path

    def publish(self, scratch_path: str) -> None:
        target = self.fs.open(self.path, "wb", block_size=_COPY_BYTES)
        try:
            with open(scratch_path, "rb") as source:
                shutil.copyfileobj(source, target, _COPY_BYTES)
        except BaseException:
            discard = getattr(target, "discard", None)
            if callable(discard):
                discard()
            try:
                # or fsspec's ``__del__`` closes it, and a buffered file (gcsfs, adlfs) would upload what it holds
                target.closed = True
            except AttributeError:
                pass
            raise
        target.close()
        log.debug(f"Copied the checkpoint into {_redacted(self.path)}.")

    def abandon(self) -> None:
        """Nothing was written to the destination before :meth:`publish`."""


def _stage_for_sequential_copy(strategy: Any, stream: Any, writer: _StreamedCheckpointFile) -> None:
    """On global rank 0, once it wrote the structure into its scratch ``writer``: check the destination's bucket
    (never created) or make its directory, and have the writer's commit copy the file there (the ``plan_units`` of
    the streamed save; ``strategy`` and ``stream`` are not needed)."""
    fs, path = url_to_fs(writer.path)
    _prepare_checkpoint_dir(fs, writer.path)
    writer.destination = _SequentialDestination(fs, path)
