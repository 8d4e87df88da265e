"""Torch's DCP file writes slowed or failing, for ``test_convert_checkpoint.py``: the converter's command line with
its writes slowed,

    python -m tests.utilities.convert_checkpoint_faults slow SECONDS -- SRC DST --to dcp

(every write of torch's DCP file writer, and every ``os.pwrite``, with which ``--to safetensors`` puts converted
tensors into their place, first sleeps ``SECONDS``, a slow disk, so that a test can kill or interrupt the conversion
mid-write), and :func:`hooked_create_stream` with :func:`enospc_after`, with which a test fails the
writes of a conversion in its own process as a full disk fails them. The hook wraps the streams of
``torch.distributed.checkpoint.filesystem.FileSystem``, the ones ``FileSystemWriter`` writes its data and metadata
files through; the rest is the command line itself.
"""
import contextlib
import errno
import os
import signal
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


def enospc_after(limit: int) -> Callable[[bytes], None]:
    """A ``before_write`` that fails the write with ``ENOSPC`` once ``limit`` bytes have been written."""
    written = 0

    def before_write(data: bytes) -> None:
        nonlocal written
        if written + len(data) > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += len(data)

    return before_write


def hooked_create_stream(before_write: Callable[[bytes], None]) -> Callable:
    """A replacement of ``FileSystem.create_stream`` whose write streams call ``before_write(data)`` first."""
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield HookedWrites(stream, before_write) if "w" in mode else stream

    return create_stream


def main() -> None:
    mode, value, separator, *argv = sys.argv[1:]
    assert mode == "slow" and separator == "--", sys.argv
    # Python's Ctrl-C handler, as in a terminal: a test run started in the background by a non-interactive shell
    # (`pytest ... &`) ignores SIGINT, and its children inherit that
    signal.signal(signal.SIGINT, signal.default_int_handler)
    slow = _slow(float(value))
    FileSystem.create_stream = hooked_create_stream(slow)
    pwrite = os.pwrite

    def slow_pwrite(fd: int, data: Any, offset: int) -> int:
        slow(data)
        return pwrite(fd, data, offset)

    os.pwrite = slow_pwrite
    convert_checkpoint.main(argv)


if __name__ == "__main__":
    main()
