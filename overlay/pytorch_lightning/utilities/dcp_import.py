"""The converter's ``--from dcp``: a torch Distributed Checkpoint directory written back as a fork checkpoint file
that 1.6.5's Trainer resumes, one tensor at a time (see ``docs/leaving-fairscale.md``).

The layout is told from the keys (``model_key``/``optim_keys`` override it):

- the converter's own: ``model`` and ``optim``;
- Lightning 2.x's: ``model``, ``optimizer_0`` ... ``optimizer_N`` and ``meta.pt`` beside them (loops, callbacks,
  epoch, step, schedulers, read through the fork's safe loader);
- torchtitan's: the model's keys at the top level (or ``model``), ``optimizer`` flattened
  (``flatten_optimizer_state_dict=True``: per-parameter hyperparameters), ``train_state`` (``step``), and
  ``lr_scheduler``/``dataloader``, which 1.6.5 has no place for.

The model is every tensor entry outside the optimizers' and those known keys. The optimizer state is the fork's: by
index, with ``param_names``, indices given in the order of the model's keys in ``.metadata``; the fork's resume
matches the names to the LightningModule's parameters (see
:func:`~pytorch_lightning.strategies.fsdp_portable_optimizer_state._fitting_optimizer_state`). Flattened groups are
rebuilt from the per-parameter hyperparameters, identical ones merged. Every pickle is read through
:mod:`~pytorch_lightning.utilities.dcp_safe_reader`.
"""
# fork-feature: fork/checkpoint-converter.patch
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from tqdm import tqdm

import pytorch_lightning as pl
from pytorch_lightning.strategies.fsdp_portable_optimizer_state import _equal_hyperparameters
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.dcp_safe_reader import _SafeFileSystemReader, _SafeLoadPlanner
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.streamed_checkpoint_file import _StreamedCheckpointFile

#: the most bytes of tensors read by one ``dcp.load`` together (a larger tensor is read alone): within the memory
#: bound of two of the largest tensors plus 16 MiB
BATCH_BYTES = 8 * 2**20
#: top-level keys of torchtitan's that are neither the model nor the optimizer: 1.6.5 has no place for them
NOT_MODEL_KEYS = ("train_state", "lr_scheduler", "dataloader")


class _DcpDirectory:
    """A DCP directory read through the safe reader: its ``.metadata`` once, then the entries asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _SafeFileSystemReader(str(path))
        metadata = self.reader.read_metadata()
        self.entries = metadata.state_dict_metadata
        #: each flattened entry's path in the state that was saved (``dcp.save``'s default planner records it)
        self.planner_data: Dict[str, Any] = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def load(self, values: Dict[str, Any]) -> Dict[str, Any]:
        """Load the entries named by the keys of ``values`` (a tensor of the entry's shape and dtype, or ``None``
        for a non-tensor entry) in one ``dcp.load``, and return them.

        Raises:
            MisconfigurationException: the directory's files cannot be read (missing, truncated) or an entry needs
                more than plain values to unpickle.
        """
        if not values:
            return values
        # flat keys as they are, the entries loaded into this very dict (a non-tensor entry is set, not copied into)
        planner = _SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        try:
            with warnings.catch_warnings():
                # one process reads every entry: ``no_dist=True`` is meant
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load(values, storage_reader=self.reader, planner=planner, no_dist=True)
        except CheckpointException as ex:
            cause = _root_cause(next(iter(ex.failures.values()))[0])
            if isinstance(cause, (KeyboardInterrupt, SystemExit, MisconfigurationException)):
                raise cause from None
            raise MisconfigurationException(
                f"{self.path} cannot be read: {', '.join(list(values)[:3])}: {type(cause).__name__}:"
                f" {' '.join(str(cause).split())}"
            ) from cause
        return values


def _root_cause(error: BaseException) -> BaseException:
    """The error to raise for ``error``, which DCP's save or load raised (DCP wraps whatever its steps raise in
    ``CheckpointException``): torch's zip writer replaces whatever a write raised (``Ctrl-C``, a ``SIGTERM``
    handler's ``SystemExit``, a full disk's ``OSError``) with ``RuntimeError: ... unexpected pos`` when it closes the
    record; Python keeps the replaced error as ``__context__``."""
    chain = [error]
    while chain[-1].__context__ is not None and len(chain) < 16:
        chain.append(chain[-1].__context__)
    for wanted in ((KeyboardInterrupt, SystemExit), MisconfigurationException, CheckpointError, OSError):
        found = next((e for e in chain if isinstance(e, wanted)), None)
        if found is not None:
            return found
    return error


def _head(key: str) -> str:
    return key.split(".", 1)[0]


def _fake(meta: TensorStorageMetadata, mode: Any) -> torch.Tensor:
    # one ``FakeTensorMode`` for every placeholder of a file: each mode holds its own state (kilobytes per tensor)
    with mode:
        return torch.empty(meta.size, dtype=meta.properties.dtype)


def _set_nested(container: Any, path: Sequence[Any], value: Any) -> None:
    """Set ``value`` at ``path`` (dict keys and list indices, as DCP's ``planner_data`` records a flattened entry)
    inside ``container``, creating the dicts and lists on the way."""
    for part, following in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(container, list):
            container.extend([None] * (part + 1 - len(container)))
            if container[part] is None:
                container[part] = empty
            container = container[part]
        else:
            container = container.setdefault(part, empty)
    if isinstance(container, list):
        container.extend([None] * (path[-1] + 1 - len(container)))
    container[path[-1]] = value


def _empty(meta: Any) -> Optional[torch.Tensor]:
    """What ``dcp.load`` loads an entry into: a tensor of its shape and dtype, or ``None`` (a non-tensor entry)."""
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    return None


def _is_indexed(entries: Dict[str, Any], optim_key: str) -> bool:
    # ``optimizer.state_dict()``'s groups, each with ``params`` (names); else flattened per parameter
    return any(re.fullmatch(re.escape(optim_key) + r"\.param_groups\.[0-9]+\.params", key) for key in entries)


def _small_entries(entries: Dict[str, Any], optim_keys: Sequence[str]) -> List[str]:
    """The entries read whole before the tensors are streamed: the groups, non-tensor optimizer state, the step."""
    heads = tuple(f"{k}.param_groups." for k in optim_keys)
    states = tuple(f"{k}.state." for k in optim_keys)
    return [
        key
        for key, meta in entries.items()
        if key.startswith(heads) or key == "train_state.step" or (key.startswith(states) and _is_bytes(meta))
    ]


def _is_bytes(meta: Any) -> bool:
    return isinstance(meta, BytesStorageMetadata)


def _optimizer_names(entries: Dict[str, Any], small: Dict[str, Any], optim_key: str) -> List[str]:
    """The parameter names the optimizer ``optim_key`` holds."""
    if _is_indexed(entries, optim_key):
        prefix = f"{optim_key}.param_groups."
        return [name for key, value in small.items() if key.startswith(prefix) and key.endswith(".params")
                for name in value]
    names: Dict[str, None] = {}
    for part in ("param_groups", "state"):
        prefix = f"{optim_key}.{part}."
        names.update({key[len(prefix) :].rsplit(".", 1)[0]: None for key in entries if key.startswith(prefix)})
    return list(names)


def _optim_keys(entries: Dict[str, Any], optim_keys: Optional[Sequence[str]]) -> List[str]:
    """The optimizers' keys, as given, or every top-level key with ``param_groups`` under it: ``optimizer_0`` ...
    ``optimizer_N`` (Lightning 2.x's) by number, ``optim`` (the converter's), ``optimizer`` (torchtitan's)."""
    heads = list(dict.fromkeys(_head(key) for key in entries))
    if optim_keys is not None and len(set(optim_keys)) != len(optim_keys):
        raise MisconfigurationException(f"An optimizer key is given twice: {list(optim_keys)}.")
    if optim_keys is None:
        found = [h for h in heads if any(key.startswith(f"{h}.param_groups.") for key in entries)]
        numbered = [h for h in found if re.fullmatch(r"optimizer_[0-9]+", h)]
        optim_keys = sorted(numbered, key=lambda h: int(h[10:])) + [h for h in found if h not in numbered]
    for key in optim_keys:
        if not any(k.startswith(f"{key}.param_groups.") for k in entries):
            raise MisconfigurationException(
                f"The DCP checkpoint holds no optimizer state under {key!r} (its top-level keys: {', '.join(heads)})."
            )
    return list(optim_keys)


def _detect_model_key(entries: Dict[str, Any], small: Dict[str, Any], optim_keys: List[str]) -> str:
    tensors = [key for key, meta in entries.items() if not _is_bytes(meta)]
    candidates = [key for key in tensors if _head(key) not in (*optim_keys, *NOT_MODEL_KEYS)]
    if not candidates or not all(key.startswith("model.") for key in candidates):
        return ""
    # all under ``model.``: the converter's and Lightning 2.x's ``model``, or a top-level model whose one child is
    # named ``model``: the optimizers' names tell which
    named = {name for key in optim_keys for name in _optimizer_names(entries, small, key)}
    if named and named <= set(candidates) and not named <= {key[len("model.") :] for key in candidates}:
        return ""
    return "model"


def _groups(
    entries: Dict[str, Any], small: Dict[str, Any], optim_key: str, names: List[str]
) -> List[Tuple[Dict[str, Any], List[str]]]:
    """The optimizer's groups as (hyperparameters, parameter names). Flattened ones are rebuilt from each
    parameter's hyperparameters, identical ones merged, in the order of the model's keys."""
    prefix = f"{optim_key}.param_groups."
    by_head: Dict[str, Dict[str, Any]] = {}
    for key in entries:
        if key.startswith(prefix):
            head, hyperparameter = key[len(prefix) :].rsplit(".", 1)
            # torch's own ``param_names`` (an optimizer built from ``named_parameters()``) name the source's
            # parameters, not the LightningModule's: the fork's ``param_names`` do that
            if hyperparameter != "param_names":
                by_head.setdefault(head, {})[hyperparameter] = small[key]
    if _is_indexed(entries, optim_key):
        indexed = sorted(by_head.items(), key=lambda item: int(item[0]))
        return [({k: v for k, v in g.items() if k != "params"}, list(g.get("params", []))) for _, g in indexed]
    known = set(names)
    # the model's names first, in its order; a name the model lacks last, for the caller to refuse
    groups: List[Tuple[Dict[str, Any], List[str]]] = []
    for name in [n for n in names if n in by_head] + [n for n in by_head if n not in known]:
        same = next((g for g in groups if _equal_hyperparameters(g[0], by_head[name])), None)
        if same is None:
            groups.append((by_head[name], []))
            same = groups[-1]
        same[1].append(name)
    return groups


def _optimizer_state(
    entries: Dict[str, Any], small: Dict[str, Any], optim_key: str, names: List[str], prefix: str, mode: Any
) -> Tuple[Dict[str, Any], Dict[Tuple[int, str], str]]:
    """The fork's optimizer state of the entries under ``optim_key`` (by index in the order of the model's keys
    ``names``, with ``param_names``), its tensors left as placeholders: returns it and, for each
    ``(index, state key)`` of a tensor, the DCP key it comes from."""
    groups = _groups(entries, small, optim_key, names)
    in_groups = [name for _, members in groups for name in members]
    known, held = set(names), set(in_groups)
    unknown = [name for name in in_groups if name not in known]
    if unknown:
        raise MisconfigurationException(
            f"The optimizer state under {optim_key!r} names parameters the model does not have: {unknown[:5]} (the"
            f" model's first: {names[:3]}). Pass `--model-key` (`model_key`) if the model is under another key."
        )
    ordered = [name for name in names if name in held]
    index_of = {name: index for index, name in enumerate(ordered)}
    state: Dict[int, Dict[str, Any]] = {}
    sources: Dict[Tuple[int, str], str] = {}
    state_prefix = f"{optim_key}.state."
    for key, meta in entries.items():
        if not key.startswith(state_prefix):
            continue
        name, state_key = key[len(state_prefix) :].rsplit(".", 1)
        if name not in index_of:
            raise MisconfigurationException(f"{key}: the optimizer's groups do not hold {name!r}.")
        if _is_bytes(meta):
            state.setdefault(index_of[name], {})[state_key] = small[key]
        else:
            state.setdefault(index_of[name], {})[state_key] = _fake(meta, mode)
            sources[(index_of[name], state_key)] = key
    param_groups = [dict(hyperparameters, params=[index_of[n] for n in members]) for hyperparameters, members in groups]
    layout = {"state": state, "param_groups": param_groups, "param_names": [prefix + name for name in ordered]}
    return layout, sources


def _import_dcp(
    src: Path,
    dst: Path,
    add_prefix: str = "",
    model_key: Optional[str] = None,
    optim_keys: Optional[Sequence[str]] = None,
    progress_bar: Callable[[int], tqdm] = lambda total: tqdm(total=total, disable=True),
) -> None:
    """Write the DCP directory ``src`` as a fork checkpoint file at ``dst`` (see the module's docstring); the
    bar ``progress_bar(bytes)`` counts the bytes of the tensors written."""
    directory = _DcpDirectory(src)
    entries = directory.entries
    optim_keys = _optim_keys(entries, optim_keys)
    small = directory.load({key: _empty(entries[key]) for key in _small_entries(entries, optim_keys)})
    if model_key is None:
        model_key = _detect_model_key(entries, small, optim_keys)
    used = {key for key in entries if _head(key) in optim_keys}
    model_prefix = f"{model_key}." if model_key else ""
    model = [
        key
        for key in entries
        if key.startswith(model_prefix)
        and key not in used
        and (model_key or _head(key) not in NOT_MODEL_KEYS)
        # a non-tensor entry only as a module's extra state: anything else beside the model's tensors is not the
        # model's (a top-level ``epoch`` or ``config`` of the writer's), and a strict load would refuse it
        and (not _is_bytes(entries[key]) or _is_extra_state(key, model_key, directory.planner_data))
    ]
    if not any(not _is_bytes(entries[key]) for key in model):
        raise MisconfigurationException(
            f"{src} holds no model tensors under {model_key or 'its top level'!r} (its top-level keys:"
            f" {', '.join(dict.fromkeys(_head(key) for key in entries))})."
        )
    used |= set(model)
    values = directory.load({key: None for key in model if _is_bytes(entries[key])})
    mode = FakeTensorMode()
    state_dict: Dict[str, Any] = {}
    names: List[str] = []  # the parameters and buffers: the model's entries that are tensors of their own
    placeholders: List[Tuple[torch.Tensor, str]] = []
    for key in model:
        path = _state_dict_path(key, model_key, directory.planner_data)
        value = values[key] if _is_bytes(entries[key]) else _fake(entries[key], mode)
        _set_nested(state_dict, (add_prefix + path[0], *path[1:]), value)
        if not _is_bytes(entries[key]):
            placeholders.append((value, key))
            if len(path) == 1:
                names.append(path[0])
    step = small.get("train_state.step")
    checkpoint: Dict[str, Any] = {
        "epoch": 0,
        "global_step": int(step) if step is not None else 0,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": state_dict,
        "optimizer_states": [],
        "lr_schedulers": [],
    }
    used |= {"train_state.step"} & set(entries)
    for optim_key in optim_keys:
        state, sources = _optimizer_state(entries, small, optim_key, names, add_prefix, mode)
        checkpoint["optimizer_states"].append(state)
        placeholders += [(state["state"][index][state_key], key) for (index, state_key), key in sources.items()]
    extra = _meta(src / "meta.pt") if (src / "meta.pt").is_file() else {}
    if extra:
        checkpoint.update({k: v for k, v in extra.items() if k not in ("state_dict", "optimizer_states")})
    _warn_what_starts_fresh(src, checkpoint, extra, _left_out(entries, used))
    with progress_bar(sum(p.nbytes for p, _ in placeholders)) as bar, _StreamedCheckpointFile(dst) as writer:
        writer.write_skeleton(checkpoint, [placeholder for placeholder, _ in placeholders])
        for batch in _batches(placeholders):
            loaded = directory.load({key: torch.empty(p.shape, dtype=p.dtype) for p, key in batch})
            for placeholder, key in batch:
                writer.write(placeholder, loaded[key])
                bar.update(placeholder.nbytes)
            del loaded
        writer.complete = True


def _batches(placeholders: List[Tuple[torch.Tensor, str]]) -> Iterator[List[Tuple[torch.Tensor, str]]]:
    """The placeholders in the batches read by one ``dcp.load`` each: small tensors together, up to
    :data:`BATCH_BYTES` (a ``dcp.load`` costs about a millisecond of planning), a larger one alone."""
    batch: List[Tuple[torch.Tensor, str]] = []
    size = 0
    for placeholder, key in placeholders:
        if batch and size + placeholder.nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append((placeholder, key))
        size += placeholder.nbytes
    if batch:
        yield batch


def _state_dict_path(key: str, model_key: str, planner_data: Dict[str, Any]) -> Tuple[Any, ...]:
    """Where the model's entry ``key`` goes in the state dict: its key, and inside the value of a module's extra state
    (``get_extra_state``, e.g. ``{"scale": ...}``, which DCP flattened) the keys and indices ``planner_data``
    recorded."""
    path = planner_data.get(key)
    parents = tuple(model_key.split(".")) if model_key else ()
    depth = len(parents) + 1
    if (
        isinstance(path, tuple)
        and len(path) > depth
        and str(path[depth - 1]).endswith(_EXTRA_STATE_KEY_SUFFIX)
        and tuple(path[: depth - 1]) == parents
    ):
        return tuple(path[depth - 1 :])
    return (key[len(model_key) + 1 :] if model_key else key,)


def _is_extra_state(key: str, model_key: str, planner_data: Dict[str, Any]) -> bool:
    return str(_state_dict_path(key, model_key, planner_data)[0]).endswith(_EXTRA_STATE_KEY_SUFFIX)


def _meta(path: Path) -> Dict[str, Any]:
    """Lightning 2.x's ``meta.pt``: the rest of its checkpoint (loops, callbacks, epoch, step, schedulers), through
    the fork's safe loader; its loops and callbacks are mapped to 1.6.5's when the file is resumed.

    Raises:
        MisconfigurationException: it cannot be read, needs more than ``weights_only`` loads, or is not a dict.
    """
    try:
        extra = pl_load(str(path), map_location="cpu")
    except Exception as ex:
        raise MisconfigurationException(
            f"{path} cannot be read: {type(ex).__name__}: {' '.join(str(ex).split())[:300]} (the converter loads it"
            " with `torch.load(weights_only=True)`; `PL_UNSAFE_CHECKPOINT_LOAD=1` unpickles a file you trust fully)."
        ) from ex
    if not isinstance(extra, dict):
        raise MisconfigurationException(f"{path} holds a {type(extra).__name__}, not Lightning's checkpoint dict.")
    return extra


def _left_out(entries: Dict[str, Any], used: set) -> List[str]:
    """The entries not converted, a top-level key with nothing converted as ``key.*``."""
    heads: Dict[str, List[str]] = {}
    for key in entries:
        heads.setdefault(_head(key), []).append(key)
    left: List[str] = []
    for head, keys in heads.items():
        unused = [key for key in keys if key not in used]
        left += [f"{head}.*" if key != head else head for key in unused[:1]] if len(unused) == len(keys) else unused
    return left if len(left) <= 8 else left[:8] + [f"and {len(left) - 8} more"]


def _warn_what_starts_fresh(src: Path, checkpoint: Dict[str, Any], extra: Dict[str, Any], left_out: List[str]) -> None:
    fresh = [] if checkpoint["optimizer_states"] else ["the optimizer state"]
    named = (("loops", "the loops"), ("callbacks", "the callbacks' state"))
    fresh += [what for key, what in named if key not in checkpoint]
    if "lr_schedulers" not in extra:
        fresh.append("a configured learning-rate scheduler")
    if not fresh and not left_out:
        return
    message = f"{src}: the file resumes at epoch {checkpoint['epoch']}, global step {checkpoint['global_step']}"
    if fresh:
        message += f"; starting fresh (not in the directory): {', '.join(fresh)}"
    if left_out:
        message += f"; left out (1.6.5 has no place for them): {', '.join(left_out)}"
    rank_zero_warn(message + ".")
