"""What the rest of Lightning needs to know of a checkpoint being saved in the background
(``DDPFullyShardedStrategy(async_checkpoint=True)``): until it is committed, its file exists only as a temporary file.

- ``ModelCheckpoint`` counts a name in flight as taken, so that the next save gets a new version (``-v1``) instead
  of replacing it, and top-k bookkeeping keeps one entry per file;
- loggers' ``after_save_checkpoint`` runs once the file is committed, with the callback's state as it was at the
  save;
- a ``KeyboardInterrupt`` finishes (or, on a second one, abandons) the save in flight before ``fit`` returns.

Strategies without background saves are not affected: every function here does what 1.6.5 did for them.
"""
# fork-feature: fork/fsdp-async-checkpoint.patch
import copy
import os
import weakref
from typing import Any, Dict, List, Optional

import pytorch_lightning as pl
from pytorch_lightning.utilities.types import _PATH

#: The callback's state at each of its saves committed in the background, by ``id`` of the ``ModelCheckpoint``:
#: loggers keep the proxy they are given (W&B with ``log_model=True`` reads it at ``finalize``), so each copy lives
#: as long as the callback, as the proxy of the callback itself would.
_COMMITTED_VIEWS: Dict[int, List[Any]] = {}


def _in_flight_path(strategy: "pl.strategies.Strategy") -> Optional[_PATH]:
    # only ``DDPFullyShardedStrategy`` saves in the background
    if not isinstance(strategy, pl.strategies.DDPFullyShardedStrategy):
        return None
    return strategy._checkpointer.in_flight_path()


def _is_in_flight(strategy: "pl.strategies.Strategy", filepath: _PATH) -> bool:
    """Whether ``filepath`` names the checkpoint being saved in the background."""
    path = _in_flight_path(strategy)
    return path is not None and os.path.realpath(os.fspath(path)) == os.path.realpath(os.fspath(filepath))


def _notify_loggers_once_committed(trainer: "pl.Trainer", checkpoint_callback: Any) -> None:
    """Call every logger's ``after_save_checkpoint`` now, or, while the save is in flight, once its file is
    committed (never if it fails), with a copy of ``checkpoint_callback`` as it is now: by then the callback may name
    its next save, whose file is not committed yet."""
    if _in_flight_path(trainer.strategy) is None:
        _call_loggers(trainer, checkpoint_callback)
        return
    view = copy.copy(checkpoint_callback)
    view.best_k_models = dict(checkpoint_callback.best_k_models)

    def notify() -> None:
        key = id(checkpoint_callback)
        if key not in _COMMITTED_VIEWS:
            weakref.finalize(checkpoint_callback, _COMMITTED_VIEWS.pop, key, None)
        _COMMITTED_VIEWS.setdefault(key, []).append(view)
        _call_loggers(trainer, view)

    trainer.strategy._checkpointer.run_once_committed(notify)


def _call_loggers(trainer: "pl.Trainer", checkpoint_callback: Any) -> None:
    for logger in trainer.loggers:
        logger.after_save_checkpoint(weakref.proxy(checkpoint_callback))


def _finish_in_flight_on_interrupt(trainer: "pl.Trainer") -> None:
    """On ``KeyboardInterrupt``, which skips the strategy's teardown: this rank's part of the save in flight is
    finished and reported before ``fit`` returns (see ``_finish_checkpoint_in_flight_alone``)."""
    if isinstance(trainer.strategy, pl.strategies.DDPFullyShardedStrategy):
        trainer.strategy._checkpointer.finish_in_flight_alone()
