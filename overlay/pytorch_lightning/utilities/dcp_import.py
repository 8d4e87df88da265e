"""The converter's ``--from dcp``: a torch Distributed Checkpoint directory written back as a fork checkpoint file
that 1.6.5's Trainer resumes, one tensor at a time (see ``docs/leaving-fairscale.md``). The layout is told from the
keys: the converter's own (``model``, ``optim``), torchtitan's (``model`` or top-level model keys, ``optimizer``
flattened, ``train_state``) and Lightning 2.x's (``model``, ``optimizer_0..N``, ``meta.pt``). Every pickle is read
through :mod:`~pytorch_lightning.utilities.dcp_safe_reader`.
"""
# fork-feature: fork/checkpoint-converter.patch
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import pytorch_lightning as pl
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.dcp_safe_reader import _SafeFileSystemReader, _SafeLoadPlanner
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile


def _load_one(src: Path, key: str, value: Any) -> Any:
    """The entry ``key`` of the DCP directory ``src``, read into ``value`` (a tensor of its shape and dtype, or any
    placeholder for a non-tensor entry) through the safe reader."""
    state = {key: value}
    # flat keys as they are, and the entries loaded into this very dict (a non-tensor entry is set, not copied into)
    planner = _SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(state, storage_reader=_SafeFileSystemReader(str(src)), planner=planner, no_dist=True)
    return state[key]


def _fake(meta: TensorStorageMetadata) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(meta.size, dtype=meta.properties.dtype)


def _optimizer_layout(
    src: Path, entries: Dict[str, Any], names: List[str], optim_key: str, prefix: str
) -> Tuple[Dict[str, Any], Dict[Tuple[int, str], str]]:
    """The fork's optimizer state (by index in the order of the model keys, with ``param_names``) of the entries under
    ``optim_key``, its tensors left as placeholders: returns it and, for each ``(index, state key)``, the DCP key it
    comes from. The groups are either indexed (``<optim>.param_groups.<i>.<hyperparameter>``, with ``params`` the
    names), or flattened per parameter (``flatten_optimizer_state_dict=True``: ``<optim>.param_groups.<name>.<hp>``),
    rebuilt then from the per-parameter hyperparameters, identical ones merged, in the order of the model keys."""
    group_prefix, state_prefix = f"{optim_key}.param_groups.", f"{optim_key}.state."
    indexed: Dict[int, Dict[str, Any]] = {}
    per_name: Dict[str, Dict[str, Any]] = {}
    for key, meta in entries.items():
        if key.startswith(group_prefix) and isinstance(meta, BytesStorageMetadata):
            head, hyperparameter = key[len(group_prefix) :].rsplit(".", 1)
            value = _load_one(src, key, None)
            if head.isdigit():
                indexed.setdefault(int(head), {})[hyperparameter] = value
            else:
                per_name.setdefault(head, {})[hyperparameter] = value
    groups = [group for _, group in sorted(indexed.items())]
    for name in names:
        if name in per_name:
            same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == per_name[name]), None)
            if same is None:
                groups.append(dict(per_name[name], params=[]))
                same = groups[-1]
            same["params"].append(name)
    in_groups = {name for group in groups for name in group.get("params", [])}
    unknown = sorted(in_groups - set(names))
    if unknown:
        raise MisconfigurationException(f"The optimizer names parameters the model does not have: {unknown[:5]}.")
    ordered = [name for name in names if name in in_groups]
    index_of = {name: index for index, name in enumerate(ordered)}
    state: Dict[int, Dict[str, Any]] = {}
    sources: Dict[Tuple[int, str], str] = {}
    for key, meta in entries.items():
        if not key.startswith(state_prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        name, state_key = key[len(state_prefix) :].rsplit(".", 1)
        if name not in index_of:
            raise MisconfigurationException(f"{key}: the optimizer's groups do not hold {name!r}.")
        state.setdefault(index_of[name], {})[state_key] = _fake(meta)
        sources[(index_of[name], state_key)] = key
    param_groups = [dict(group, params=[index_of[name] for name in group.get("params", [])]) for group in groups]
    layout = {"state": state, "param_groups": param_groups, "param_names": [prefix + name for name in ordered]}
    return layout, sources


def _layout_keys(entries: Dict[str, Any]) -> Tuple[str, List[str]]:
    """The model's and the optimizers' keys of a DCP directory: ``model`` (or ``""``: the model's keys at the top
    level, torchtitan's alternative), and ``["optim"]`` (this converter's), ``["optimizer"]`` (torchtitan's),
    ``["optimizer_0", ..., "optimizer_N"]`` (Lightning 2.x's) or ``[]``."""
    model_key = "model" if any(k.startswith("model.") for k in entries) else ""
    heads = {key.split(".", 1)[0] for key in entries}
    numbered = sorted((h for h in heads if re.fullmatch(r"optimizer_[0-9]+", h)), key=lambda h: int(h.split("_")[1]))
    optim_keys = numbered or [k for k in ("optim", "optimizer") if k in heads][:1]
    return model_key, optim_keys


def _import_dcp(src: Path, dst: Path, add_prefix: str = "") -> None:
    """Write the DCP directory ``src`` (the converter's layout, torchtitan's, or Lightning 2.x's with ``meta.pt``) as
    a fork checkpoint file at ``dst``."""
    metadata = _SafeFileSystemReader(str(src)).read_metadata()
    entries = metadata.state_dict_metadata
    model_key, optim_keys = _layout_keys(entries)
    others = tuple(f"{key}." for key in optim_keys) + ("train_state.",)
    if model_key:
        model = {k[len("model.") :]: m for k, m in entries.items() if k.startswith("model.")}
    else:
        model = {k: m for k, m in entries.items() if not k.startswith(others)}
    step = entries.get("train_state.step")
    if not model or not all(isinstance(m, TensorStorageMetadata) for m in model.values()):
        raise MisconfigurationException(f"{src} holds no `model` of tensors (keys: {', '.join(list(entries)[:5])}).")
    state_dict = {add_prefix + name: _fake(meta) for name, meta in model.items()}
    pending = {add_prefix + name: f"{model_key}.{name}" if model_key else name for name in model}
    global_step = int(_load_one(src, "train_state.step", None)) if isinstance(step, BytesStorageMetadata) else 0
    checkpoint: Dict[str, Any] = {
        "epoch": 0,
        "global_step": global_step,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": state_dict,
        "optimizer_states": [],
        "lr_schedulers": [],
    }
    placeholders = [(state_dict[name], key) for name, key in pending.items()]
    for optim_key in optim_keys:
        layout, sources = _optimizer_layout(src, entries, list(model), optim_key, add_prefix)
        checkpoint["optimizer_states"].append(layout)
        placeholders += [(layout["state"][index][state_key], key) for (index, state_key), key in sources.items()]
    meta = src / "meta.pt"
    if meta.is_file():
        # Lightning 2.x's: the rest of its checkpoint (loops, callbacks, epoch, step, schedulers), through the fork's
        # safe loader; its loops and callbacks are mapped to 1.6.5's when the file is resumed
        extra = pl_load(str(meta), map_location="cpu")
        checkpoint.update({k: v for k, v in extra.items() if k not in ("state_dict", "optimizer_states")})
    fresh = [key for key in ("loops", "callbacks", "lr_schedulers") if not checkpoint.get(key)]
    if fresh:
        rank_zero_warn(
            f"{src} holds no Lightning {', '.join(fresh)}: they start fresh (epoch {checkpoint['epoch']}, step"
            f" {checkpoint['global_step']})."
        )
    with _StreamedCheckpointFile(dst) as writer:
        writer.write_skeleton(checkpoint, [placeholder for placeholder, _ in placeholders])
        for placeholder, key in placeholders:
            values = _load_one(src, key, torch.empty(placeholder.shape, dtype=placeholder.dtype))
            writer.write(placeholder, values)
            del values
        writer.complete = True
