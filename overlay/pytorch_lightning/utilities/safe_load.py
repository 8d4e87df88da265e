"""Safe checkpoint loading: checkpoints are loaded with ``torch.load(weights_only=True)``, which runs no code from
the file, allowing the few Python types that Lightning itself writes into checkpoints.

A checkpoint is a pickle: loaded with ``weights_only=False``, a file from a shared bucket, a colleague or a model hub
runs whatever code it carries. The hooks are ``cloud_io.load(weights_only=...)``, which every load path of
Lightning goes through, the ``weights_only`` argument of ``Trainer.fit/validate/test/predict`` and of
``LightningModule.load_from_checkpoint``, Lightning's other loads (``upgrade_checkpoint``, DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict``, ``TPUSpawnStrategy.broadcast``), and the tuners, which restore a
checkpoint this process wrote itself (:func:`loading_own_file`).
"""
# fork-feature: fork/safe-checkpoint-load.patch
import argparse
import contextvars
import enum
import inspect
import os
import pickle
import re
import threading
from contextlib import contextmanager
from typing import Any, Callable, FrozenSet, Generator, List, Optional

import torch

from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_error_type
from pytorch_lightning.utilities.imports import _fault_tolerant_training
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.types import _PATH

#: Set to ``1`` to load checkpoints with ``weights_only=False`` wherever a call does not choose, for pipelines that
#: load only files they trust and hold other Python objects in them.
UNSAFE_LOAD_ENV = "PL_UNSAFE_CHECKPOINT_LOAD"

# ``weights_only`` exists since torch 1.13, the allow-list (``safe_globals``) since torch 2.5.
_WEIGHTS_ONLY_AVAILABLE = "weights_only" in inspect.signature(torch.load).parameters
_SAFE_GLOBALS_AVAILABLE = hasattr(torch.serialization, "safe_globals")

# The ``weights_only`` of the ``Trainer`` call that is loading a checkpoint (``None``: it did not choose).
_trainer_choice: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("_trainer_choice", default=None)
# The files this process has just written itself and may load fully (see ``loading_own_file``), normalised.
_own_files: contextvars.ContextVar[FrozenSet[str]] = contextvars.ContextVar("_own_files", default=frozenset())
_warned: set = set()
_SAFE_GLOBALS_LOCK = threading.RLock()


def lightning_safe_globals() -> List[Any]:
    """The types that Lightning writes into checkpoints and that torch's ``weights_only`` unpickler refuses.

    - ``AttributeDict`` and ``argparse.Namespace``: hyperparameters saved by ``save_hyperparameters()``.
    - Lightning's enums (``pytorch_lightning.utilities.enums``, ``pytorch_lightning.trainer.states``), which appear
      in hyperparameters; unpickling an enum only looks a member up by value.
    - With omegaconf installed, its containers, nodes and metadata: Lightning saves OmegaConf hyperparameters and their
      type as they are (``hparams_type``). Unpickling them sets attributes and builds plain values. Interpolations
      (``${...}``) in them are resolved later, when the values are read, by the resolvers the program registered: a
      program that registers a resolver that runs code (an ``eval`` resolver) runs it for a file's interpolation too.

    None of them runs code when it is unpickled: each is built from plain values and has no ``__setstate__`` or
    ``__reduce__`` that calls anything a file could choose.
    """
    from pytorch_lightning.trainer import states
    from pytorch_lightning.utilities import enums
    from pytorch_lightning.utilities.parsing import AttributeDict

    allowed: List[Any] = [AttributeDict, argparse.Namespace]
    for module in (enums, states):
        allowed += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, enum.Enum) and value.__module__ == module.__name__
        ]
    allowed += _omegaconf_globals()
    return allowed


def _omegaconf_globals() -> List[Any]:
    try:
        import collections
        import typing

        import omegaconf
        from omegaconf import base, nodes
    except ImportError:
        return []
    node_types = [
        value
        for value in vars(nodes).values()
        if isinstance(value, type) and issubclass(value, base.Node) and value.__module__ == nodes.__name__
    ]
    metadata = [base.Metadata, base.ContainerMetadata]
    # the metadata refers to these as types (``ref_type``, ``key_type``, ``element_type``), never calls them with
    # anything but plain values
    plain = [collections.defaultdict, dict, list, int, float, str, bool, bytes, typing.Any]
    return [omegaconf.DictConfig, omegaconf.ListConfig, *node_types, *metadata, *plain]


def resolve_weights_only(weights_only: Optional[bool]) -> bool:
    """The ``weights_only`` a load uses: the caller's choice, else the ``Trainer`` call's, else ``False`` if
    ``PL_UNSAFE_CHECKPOINT_LOAD=1`` or with fault-tolerant training, else ``True``.

    Fault-tolerant training (``PL_FAULT_TOLERANT_TRAINING``, experimental in Lightning 1.6) writes the reduction
    functions of logged metrics and numpy random states into its checkpoints, which no allow-list can load safely.
    """
    if weights_only is None:
        weights_only = _trainer_choice.get()
    if weights_only is None:
        unsafe = os.environ.get(UNSAFE_LOAD_ENV, "0").lower() in ("1", "true", "yes")
        weights_only = not (unsafe or _fault_tolerant_training())
    return bool(weights_only)


@contextmanager
def trainer_weights_only(weights_only: Optional[bool]) -> Generator[None, None, None]:
    """Within the block, loads that do not choose use ``weights_only``; ``None`` makes no choice here.

    Args:
        weights_only: the ``weights_only`` argument of the ``Trainer`` call.
    """
    if weights_only is None:
        yield
        return
    token = _trainer_choice.set(weights_only)
    try:
        yield
    finally:
        _trainer_choice.reset(token)


@contextmanager
def loading_own_file(path: _PATH) -> Generator[None, None, None]:
    """Within the block, a load of ``path`` that does not choose unpickles it fully, without a warning: ``path`` is a
    checkpoint this process has just written itself (the tuners' initial state, the structure of a streamed save),
    which may hold whatever the user's objects hold. The ``Trainer`` call's choice and ``PL_UNSAFE_CHECKPOINT_LOAD``
    do not apply to it. Any other file loaded within the block, such as an ``hpc_ckpt_<N>.ckpt`` that
    ``CheckpointConnector.restore`` picks instead of ``path``, is loaded as it would be outside.

    Args:
        path: the file, by the path the load names it with.
    """
    token = _own_files.set(_own_files.get() | {_normalised(path)})
    try:
        yield
    finally:
        _own_files.reset(token)


def _normalised(path: _PATH) -> str:
    path = os.fspath(path)
    return path if "://" in path else os.path.realpath(path)


def safe_load(
    load: Callable[..., Any], source: str, *args: Any, weights_only: Optional[bool] = None, **kwargs: Any
) -> Any:
    """Call ``load(*args, weights_only=..., **kwargs)`` (``torch.load`` or ``torch.hub.load_state_dict_from_url``)
    with ``weights_only`` resolved by :func:`resolve_weights_only`.

    Args:
        load: the loading function; it takes a ``weights_only`` keyword.
        source: the file or URL being loaded, for the messages; a file of :func:`loading_own_file` is unpickled
            fully unless ``weights_only`` says otherwise.
        weights_only: ``True`` runs no code from the file, allowing :func:`lightning_safe_globals` and what the user
            allowed with ``torch.serialization.add_safe_globals``; ``False`` unpickles it fully; ``None`` decides
            by the ``Trainer`` call and ``PL_UNSAFE_CHECKPOINT_LOAD``.

    Raises:
        CheckpointError: An instance of ``pickle.UnpicklingError`` too, if the file holds a global that is not
            allowed; it names the global, the file and the two ways forward. Other unpickling errors (a corrupted
            file) are raised as ``torch.load`` raised them.
    """
    own_files = _own_files.get()
    own_file = weights_only is None and bool(own_files) and _normalised(source) in own_files
    if own_file:
        weights_only = False
    chosen = weights_only if weights_only is not None else _trainer_choice.get()
    weights_only = resolve_weights_only(weights_only)
    if _WEIGHTS_ONLY_AVAILABLE and not _SAFE_GLOBALS_AVAILABLE and chosen is True:
        # asked for explicitly: safe, even without the types Lightning writes, which this torch cannot allow
        return load(*args, weights_only=True, **kwargs)
    if not _WEIGHTS_ONLY_AVAILABLE or (weights_only and not _SAFE_GLOBALS_AVAILABLE):
        _warn_once(
            "old-torch",
            f"torch {torch.__version__} cannot load checkpoints with `weights_only=True` and an allow-list (torch 2.5"
            " can): checkpoints are unpickled fully, which runs any code they carry. Load only files you trust.",
        )
        if _WEIGHTS_ONLY_AVAILABLE:
            kwargs["weights_only"] = False
        return load(*args, **kwargs)
    if not weights_only:
        if not own_file:
            _warn_once(
                "unsafe",
                "Loading checkpoints with `weights_only=False` unpickles them fully: a checkpoint can run any code when"
                " it is loaded, on every rank. Do this only for files you trust.",
            )
        return load(*args, weights_only=False, **kwargs)
    return _load_with_lightning_safe_globals(load, source, *args, **kwargs)


def _load_with_lightning_safe_globals(load: Callable[..., Any], source: str, *args: Any, **kwargs: Any) -> Any:
    """``load(*args, weights_only=True, **kwargs)`` with the types Lightning writes allowed too; a global that is not
    allowed raises the error of :func:`_refused`."""
    try:
        # ``safe_globals`` removes its types from torch's process-wide allow-list on exit: only those the user did
        # not allow already, and one load at a time
        with _SAFE_GLOBALS_LOCK:
            allowed = {id(entry[0] if isinstance(entry, tuple) else entry) for entry in _user_safe_globals()}
            missing = [value for value in lightning_safe_globals() if id(value) not in allowed]
            with torch.serialization.safe_globals(missing):
                return load(*args, weights_only=True, **kwargs)
    except pickle.UnpicklingError as ex:
        refused = _refused(source, ex)
        if refused is None:
            raise
        raise refused from ex


def _user_safe_globals() -> List[Any]:
    get_safe_globals = getattr(torch.serialization, "get_safe_globals", None)
    return list(get_safe_globals()) if get_safe_globals is not None else []


def _refused(source: str, error: pickle.UnpicklingError) -> Optional[BaseException]:
    """The error to raise for the globals that ``error`` reports refusing, or ``None`` if it refused none (a corrupted
    file, or a construct torch's safe unpickler does not build, whose own message says so)."""
    names = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(error))))
    if not names:
        return None
    shown = ", ".join(f"`{name}`" for name in names)
    message = (
        f"The checkpoint {source!r} holds {shown}, which `weights_only=True` does not load: unpickling it could run"
        " code from the file. If you trust the file, load it with `weights_only=False` (for example"
        " `trainer.fit(model, ckpt_path=..., weights_only=False)` or `Model.load_from_checkpoint(...,"
        " weights_only=False)`, or set `PL_UNSAFE_CHECKPOINT_LOAD=1`); if you trust the type, allow it with"
        f" `torch.serialization.add_safe_globals([{', '.join(names)}])`."
    )
    return _checkpoint_error_type(pickle.UnpicklingError)(message)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        rank_zero_warn(message)
