"""A checkpoint that runs code when it is unpickled: an ordinary Lightning checkpoint plus one callback-state entry
whose unpickling calls ``os.system``, which creates a marker file. Whether the marker exists tells whether a load
ran the payload."""
import os
import shlex
from pathlib import Path

import torch


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        # what a hostile file carries: unpickling calls ``os.system(command)``
        return os.system, (self.command,)


def make_malicious_checkpoint(good: Path, bad: Path, marker: Path) -> None:
    """Write ``bad``: the checkpoint at ``good`` with a callback state that creates ``marker`` when unpickled."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=False)
    checkpoint.setdefault("callbacks", {})["Innocent"] = {"payload": _RunsCommand(f"touch {shlex.quote(str(marker))}")}
    torch.save(checkpoint, bad)
