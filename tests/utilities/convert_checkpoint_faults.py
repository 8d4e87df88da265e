"""The converter's command line with its DCP writes hooked, for ``test_convert_checkpoint.py``:

    python -m tests.utilities.convert_checkpoint_faults slow SECONDS -- SRC DST --to dcp
    python -m tests.utilities.convert_checkpoint_faults enospc BYTES -- SRC DST --to dcp

``slow``: every write of torch's DCP file writer first sleeps ``SECONDS`` (a slow disk), so that a test can kill or
interrupt the conversion mid-write. ``enospc``: once ``BYTES`` have been written, writes fail with ``ENOSPC`` as a
full disk fails them. The hook wraps the streams of ``torch.distributed.checkpoint.filesystem.FileSystem``, the ones
``FileSystemWriter`` writes its data and metadata files through; the rest is the command line itself.
"""
import contextlib
import errno
import os
import sys
import time
from typing import Any, Callable, Iterator

from torch.distributed.checkpoint.filesystem import FileSystem

from pytorch_lightning.utilities import convert_checkpoint
from tests.helpers.write_hook import HookedWrites


def _slow(seconds: float) -> Callable[[bytes], None]:
    def before_write(data: bytes) -> None:
        time.sleep(seconds)

    return before_write


def _enospc(limit: int) -> Callable[[bytes], None]:
    written = 0

    def before_write(data: bytes) -> None:
        nonlocal written
        if written + len(data) > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += len(data)

    return before_write


def _hook_writes(before_write: Callable[[bytes], None]) -> None:
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield HookedWrites(stream, before_write) if "w" in mode else stream

    FileSystem.create_stream = create_stream


def main() -> None:
    mode, value, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    _hook_writes(_slow(float(value)) if mode == "slow" else _enospc(int(value)))
    convert_checkpoint.main(argv)


if __name__ == "__main__":
    main()
