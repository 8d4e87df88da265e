"""Where a checkpoint's bytes go and come from: one interface, :class:`_CheckpointStorage`, for every save and load of
the FSDP strategy's checkpoints, and its three implementations.

A save is staged by global rank 0 in a local file of its own (the streamed checkpoint file, see
:mod:`~pytorch_lightning.utilities.streamed_checkpoint_file`): the checkpoint's structure, and the values rank 0
writes, through the same writer as a local file's (``_LocalFileWriter``). The storage then takes the byte ranges the
other ranks hold (:meth:`~_CheckpointStorage.write`, in a parallel save), makes the checkpoint appear at its path once
every rank's writes succeeded (:meth:`~_CheckpointStorage.commit`, on global rank 0), or leaves nothing behind
(:meth:`~_CheckpointStorage.discard`, on global rank 0); a load from object storage reads byte ranges of a committed
checkpoint (:meth:`~_CheckpointStorage.read_ranges`; a local load maps the file instead, whose pages are read as they
are touched). The three kinds:

- **Local files** (:class:`~pytorch_lightning.utilities.local_file_storage._LocalFileStorage`; anything mounted, NFS
  and Lustre included): the staged file is the temporary file beside the checkpoint; every rank writes its ranges
  into it in place, and the commit renames it over the checkpoint.
- **Multipart objects** (:class:`~pytorch_lightning.utilities.object_storage._MultipartObjectStorage`: S3 and
  S3-compatible stores, through s3fs): the staged file is a sparse scratch file holding the structure; every rank
  uploads whole parts of one object, and the commit completes the multipart upload.
- **Sequential streams** (:class:`~pytorch_lightning.utilities.object_storage._SequentialStreamStorage`: any other
  ``fsspec`` filesystem, such as ``gs://`` through gcsfs or ``az://`` through adlfs, and S3 with
  ``checkpoint_writers="rank0"``): the staged file is a scratch file holding the whole checkpoint, written by global
  rank 0 alone, and the commit copies it into the destination in one write stream, in file order.

Which kind a path takes: :mod:`~pytorch_lightning.utilities.checkpoint_storage_kinds`. A storage is a small picklable
value: global rank 0 makes it, and sends it to every rank with its plan of a parallel save (local files, multipart
objects); a load makes its own for reading (multipart objects, sequential streams).
"""
# fork-feature: fork/object-storage-checkpoints.patch
from abc import ABC, abstractmethod
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from pytorch_lightning.utilities.checkpoint_crc import _CrcLedger
from pytorch_lightning.utilities.checkpoint_location import _redacted

#: Bytes of a checkpoint to write: their offset in it, and a flat byte tensor (``torch.uint8``, any device).
_Extent = Tuple[int, torch.Tensor]
#: A byte range ``[start, end)`` of a checkpoint.
_Range = Tuple[int, int]


class _CheckpointStorage(ABC):
    """One checkpoint's bytes in one kind of storage (see the module's docstring). Every rank may :meth:`write` and
    :meth:`read_ranges`; only global rank 0, which staged the save, may :meth:`commit` or :meth:`discard` it (on
    another rank they would publish or remove the one save every rank shares)."""

    #: the checkpoint's path or URL
    url: str

    @abstractmethod
    def write(self, extents: Iterable[_Extent], crcs: Optional[_CrcLedger] = None) -> List[Any]:
        """Write the bytes of ``extents`` at their offsets of the checkpoint; returns what :meth:`commit` needs of them
        (the ranks' returns go to global rank 0). Nothing is visible at :attr:`url` before the commit. A storage that
        writes in place notes each piece's CRC-32 in ``crcs`` as it writes it; one that takes whole parts (which hold
        the records' CRC-32 fields) needs the CRC-32s before, and leaves ``crcs`` alone.

        Raises:
            ValueError: if the storage was made for reading only.
        """

    @abstractmethod
    def commit(self, receipts: Sequence[Any]) -> None:
        """On global rank 0, once its staged file is final and every rank's writes succeeded, with every rank's
        receipts: make the checkpoint appear at :attr:`url`, at once, replacing any earlier one; the staged file is
        gone afterwards."""

    @abstractmethod
    def discard(self) -> None:
        """On global rank 0, where the save failed: remove what the save wrote (the staged file too); an earlier
        checkpoint at :attr:`url` stays as it was."""

    @abstractmethod
    def read_ranges(self, ranges: Sequence[_Range]) -> List[bytes]:
        """The bytes of ``ranges`` of the checkpoint at :attr:`url`, read concurrently where the storage allows.

        Raises:
            OSError: if the checkpoint changed since this storage was made for reading it (where the storage can
                tell) or a range is past its end (see :func:`_whole_ranges`).
        """


def _whole_ranges(url: str, ranges: Sequence[_Range], data: List[bytes]) -> List[bytes]:
    """``data``, read for ``ranges`` of the checkpoint at ``url``, once each range is checked whole.

    Raises:
        OSError: if a range came short (past the end of the checkpoint: it is not the one the reader expects).
    """
    for (start, end), chunk in zip(ranges, data):
        if len(chunk) != end - start:
            raise OSError(
                f"A ranged read of {_redacted(url)} at {start} gave {len(chunk)} bytes, not {end - start}: the"
                " checkpoint changed while it was loaded. Load it again."
            )
    return data
