"""Damaged checkpoint files, made from a good one, for the tests of what resuming from them does."""
from pathlib import Path

import torch

#: Every kind :func:`make_bad_checkpoint` makes. ``missing`` writes nothing.
KINDS = ("missing", "empty", "random", "truncated", "not_a_checkpoint", "wrong_keys")


def make_bad_checkpoint(kind: str, good: Path, path: Path) -> None:
    """Write a checkpoint of ``kind`` (one of :data:`KINDS`) at ``path``, made from the good checkpoint ``good``."""
    if kind == "missing":
        return
    data = good.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        # as long as the good file, and the same bytes in every run
        generator = torch.Generator().manual_seed(0)
        path.write_bytes(torch.randint(0, 256, (len(data),), dtype=torch.uint8, generator=generator).numpy().tobytes())
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "not_a_checkpoint":
        torch.save([1, 2, 3], path)
    elif kind == "wrong_keys":
        # a loadable checkpoint whose state dict does not fit the model
        checkpoint = torch.load(good, weights_only=False)
        checkpoint["state_dict"] = {"encoder." + k: v for k, v in checkpoint["state_dict"].items()}
        torch.save(checkpoint, path)
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
