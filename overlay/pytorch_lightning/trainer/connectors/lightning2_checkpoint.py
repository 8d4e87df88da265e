# fork-feature: fork/lightning2-checkpoints.patch
"""Resume a checkpoint written by Lightning 2.x: its loop and callback states under Lightning 1.6.5's names.

Lightning 2.0 moved the training epoch loop's optimizer loop and manual loop into the epoch loop itself (as
``automatic_optimization`` and ``manual_optimization``), removed the evaluation loops' inner epoch loop, and dropped
``save_on_train_epoch_end`` from ``ModelCheckpoint``'s state key. Lightning 1.6.5 restores each loop and callback
state by its name and passes over the names it does not know, so a Lightning 2.x file resumed here silently lost the
global step of a manually optimized module (it restarted at 0) and ``ModelCheckpoint``'s best and last checkpoints
(with a warning to add the very callback that was there). :func:`from_lightning2` renames the states that have a
counterpart here; a loop state that has none is named in a warning.
"""
from typing import Any, Dict, Iterable, List, Tuple

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_warn

_Renames = Tuple[Tuple[str, str], ...]
# A key of Lightning 2.x's loop state that starts with the first prefix is 1.6.5's key with the second one.
_TRAINING_RENAMES: _Renames = (
    ("epoch_loop.automatic_optimization.", "epoch_loop.batch_loop.optimizer_loop."),
    ("epoch_loop.manual_optimization.", "epoch_loop.batch_loop.manual_loop."),
    ("epoch_loop.val_loop.batch_progress", "epoch_loop.val_loop.epoch_loop.batch_progress"),
)
_EVALUATION_RENAMES: _Renames = (("batch_progress", "epoch_loop.batch_progress"),)
_LOOP_RENAMES: Dict[str, _Renames] = {
    "fit_loop": _TRAINING_RENAMES,
    "validate_loop": _EVALUATION_RENAMES,
    "test_loop": _EVALUATION_RENAMES,
    "predict_loop": _EVALUATION_RENAMES,
}
_OPTIM_PROGRESS = "epoch_loop.batch_loop.optimizer_loop.optim_progress"


def is_lightning2_checkpoint(checkpoint: Dict[str, Any]) -> bool:
    """Whether the file's loops are Lightning 2.x's, told by what they hold (not by the version it names): only
    there does the training epoch loop have ``automatic_optimization`` or ``manual_optimization`` states."""
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    return any(key.startswith(prefix) for key in fit_loop for prefix, _ in _TRAINING_RENAMES[:2])


def from_lightning2(checkpoint: Dict[str, Any], trainer: "pl.Trainer") -> Dict[str, Any]:
    """Rename, in place, the loop and callback states of a Lightning 2.x checkpoint to what ``trainer`` restores;
    warn naming the loop states that have no counterpart here. Any other checkpoint is returned as it is.

    Args:
        checkpoint: the loaded checkpoint.
        trainer: the trainer that restores it (its loops and callbacks).
    """
    if not is_lightning2_checkpoint(checkpoint):
        return checkpoint
    loops = checkpoint["loops"]
    for name, renames in _LOOP_RENAMES.items():
        if name in loops:
            loops[name] = {_renamed(key, renames): state for key, state in loops[name].items()}
    if _OPTIM_PROGRESS in loops["fit_loop"]:
        # Lightning 2.x optimizes automatically with one optimizer, so its position is always the first.
        loops["fit_loop"][_OPTIM_PROGRESS] = {**loops["fit_loop"][_OPTIM_PROGRESS], "optimizer_position": 0}
    _rekey_model_checkpoints(checkpoint.get("callbacks") or {}, trainer.callbacks)
    unknown = _without_counterpart(loops, trainer)
    if unknown:
        rank_zero_warn(
            f"The checkpoint was written by Lightning {checkpoint.get('pytorch-lightning_version', '2.x')}; these"
            f" loop states have no counterpart in Lightning 1.6.5 and are not restored: {', '.join(unknown)}."
        )
    return checkpoint


def _renamed(key: str, renames: _Renames) -> str:
    for new, old in renames:
        if key.startswith(new):
            return old + key[len(new) :]
    return key


def _rekey_model_checkpoints(states: Dict[str, Any], callbacks: Iterable[Any]) -> None:
    """Put each ``ModelCheckpoint``'s state under its 1.6.5 key, which also names ``save_on_train_epoch_end``."""
    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.state_key in states:
            continue
        lightning2_key = callback._generate_state_key(
            monitor=callback.monitor,
            mode=callback.mode,
            every_n_train_steps=callback._every_n_train_steps,
            every_n_epochs=callback._every_n_epochs,
            train_time_interval=callback._train_time_interval,
        )
        if lightning2_key in states:
            states[callback.state_key] = states.pop(lightning2_key)


def _without_counterpart(loops: Dict[str, Dict[str, Any]], trainer: "pl.Trainer") -> List[str]:
    """The file's loop states that the trainer's loops do not read."""
    unknown = []
    for name, state in loops.items():
        loop = getattr(trainer, name, None)
        known = set(loop.state_dict()) if loop is not None else set()
        unknown += [f"{name}.{key}" for key in state if key not in known]
    return unknown
