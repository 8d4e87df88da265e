"""Compare two checkpoint files for byte identity, except for the version string every checkpoint stores.

Usage: ``python tools/compare_checkpoints.py OLD NEW [OLD NEW ...]``

Both files are loaded on the CPU (``torch.load(weights_only=False)``: they are our own files), their
``pytorch-lightning_version`` is set equal, and the two objects are compared: the same structure (types, dict keys in
order, sequence lengths, every non-tensor value) and, for every tensor, the same dtype, shape, stride and bytes. Exits
non-zero and names the first difference of each pair that differs.
"""
import os
import sys
from typing import Any, Iterator, Tuple

import torch

VERSION_KEY = "pytorch-lightning_version"


def _differences(old: Any, new: Any, where: str = "checkpoint") -> Iterator[str]:
    if type(old) is not type(new):
        yield f"{where}: {type(old).__name__} != {type(new).__name__}"
    elif isinstance(old, torch.Tensor):
        if (old.dtype, old.shape, old.stride()) != (new.dtype, new.shape, new.stride()):
            yield f"{where}: {old.dtype} {tuple(old.shape)} != {new.dtype} {tuple(new.shape)} (or strides differ)"
        elif not _same_bytes(old, new):
            yield f"{where}: the tensor bytes differ"
    elif isinstance(old, dict):
        if list(old) != list(new):
            yield f"{where}: keys {list(old)} != {list(new)}"
            return
        for key in old:
            yield from _differences(old[key], new[key], f"{where}[{key!r}]")
    elif isinstance(old, (list, tuple)):
        if len(old) != len(new):
            yield f"{where}: length {len(old)} != {len(new)}"
            return
        for i, (a, b) in enumerate(zip(old, new)):
            yield from _differences(a, b, f"{where}[{i}]")
    elif old != new:
        yield f"{where}: {old!r} != {new!r}"


def _same_bytes(old: torch.Tensor, new: torch.Tensor) -> bool:
    # compared as raw bytes, so that NaNs and -0.0 count as what they are
    as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (old, new)]
    return torch.equal(*as_bytes)


def compare(old_path: str, new_path: str) -> Tuple[bool, str]:
    """Whether the checkpoints at the two paths are the same apart from their version, and what differs."""
    old, new = (torch.load(p, map_location="cpu", weights_only=False) for p in (old_path, new_path))
    if isinstance(old, dict) and isinstance(new, dict) and VERSION_KEY in old and VERSION_KEY in new:
        new[VERSION_KEY] = old[VERSION_KEY]
    differences = list(_differences(old, new))
    return not differences, "; ".join(differences[:5])


def main(argv: list) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    failed = 0
    for old_path, new_path in zip(argv[::2], argv[1::2]):
        missing = [path for path in (old_path, new_path) if not os.path.isfile(path)]
        if missing:
            print(f"MISSING: {', '.join(missing)}")
            failed += 1
            continue
        same, detail = compare(old_path, new_path)
        print(f"{'identical' if same else 'DIFFERENT'}: {old_path} vs {new_path}" + ("" if same else f": {detail}"))
        failed += not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
