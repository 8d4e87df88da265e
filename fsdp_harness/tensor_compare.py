"""Compare every tensor of two checkpoints (or any nest of dicts, lists and tuples) exactly.

Used to check that two ways of writing the same checkpoint (e.g. the fork's streamed and gathered saves) wrote the
same values: the model state dict and every tensor inside ``optimizer_states``, however deeply nested.
"""
from typing import Any, Dict, Iterator, List, Tuple

import torch

Path = Tuple[Any, ...]


def iter_tensors(obj: Any, path: Path = ()) -> Iterator[Tuple[Path, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in ``obj``; a path is the tuple of keys and indices leading to it (a
    tuple, not a dotted string, because state-dict keys contain dots themselves)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensors(value, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from iter_tensors(value, path + (index,))


def compare_tensors(expected: Any, actual: Any) -> Dict[str, Any]:
    """``compared`` (tensors present in both), ``mismatched`` (paths, as ``/``-joined strings, whose tensors differ
    in dtype, shape or any value, or that only one side has) and ``ok``. Only tensors are compared; other leaves are
    ignored."""
    left, right = dict(iter_tensors(expected)), dict(iter_tensors(actual))
    mismatched: List[Path] = sorted(set(left) ^ set(right), key=str)
    common = [path for path in left if path in right]
    for path in common:
        a, b = left[path], right[path]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            mismatched.append(path)
    return {"compared": len(common), "mismatched": ["/".join(map(str, p)) for p in mismatched], "ok": not mismatched}
