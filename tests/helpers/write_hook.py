"""Files whose every ``write`` first calls a hook, to make a disk fill up or a write take long in a test."""
import os
from typing import Any, Callable


class HookedWrites:
    """Wraps an open file: ``write(data)`` calls ``before_write(data)`` (which may raise or sleep), then writes."""

    def __init__(self, f: Any, before_write: Callable[[bytes], None]) -> None:
        self._f, self._before_write = f, before_write

    def write(self, data: bytes) -> int:
        self._before_write(data)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> "HookedWrites":
        return self

    def __exit__(self, *args: Any) -> None:
        self._f.close()


def hooked_fdopen(before_write: Callable[[bytes], None]) -> Callable[..., HookedWrites]:
    """A replacement for ``os.fdopen`` (the call ``atomic_save`` opens its temporary file with) whose files call
    ``before_write``."""
    real_fdopen = os.fdopen
    return lambda *args, **kwargs: HookedWrites(real_fdopen(*args, **kwargs), before_write)
