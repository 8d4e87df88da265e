"""Where a ``ckpt_path`` is restored on strategies that restore before ``setup`` (DDP, a single device, ...): before
``configure_sharded_model``, as in Lightning 1.6.5, or after it when only that hook creates the checkpoint's layers.

1.6.5 restores the model, datamodule and callbacks before ``configure_sharded_model`` on every strategy whose
``restore_checkpoint_after_setup`` is ``False``. A LightningModule that creates its layers in that hook, as
Lightning's docs recommend for large models (and as the fork's FSDP restore, after the hook, supports), then fails to
load even its weights there: the checkpoint's keys are unexpected. Such a restore now runs right after the hook, still
before ``strategy.setup``, so before DDP wraps the model and before the optimizers exist, whose state is restored
later as before. Every other restore keeps 1.6.5's order and calls; keys still missing after the hook raise the usual
strict-load error.

The hooks are the call in ``Trainer._run`` and ``Trainer._restore_loaded_modules_and_callbacks``, the part of
``Trainer._restore_modules_and_callbacks`` after the load.
"""
# fork-feature: fork/restore-after-configure-sharded-model.patch
from typing import List, Optional

import pytorch_lightning as pl
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from pytorch_lightning.utilities.types import _PATH


def keys_not_yet_in_module(trainer: "pl.Trainer") -> List[str]:
    """The keys of the loaded checkpoint's ``state_dict`` that the LightningModule does not have (yet).

    Every rank loads the same file into the same module, so the ranks agree.

    Args:
        trainer: the trainer, after ``CheckpointConnector.resume_start`` and before ``configure_sharded_model``.
    """
    state_dict = trainer._checkpoint_connector._loaded_checkpoint.get("state_dict") or {}
    # `keep_vars` hands out the module's own tensors: only the names are read, nothing is copied
    own = trainer.lightning_module.state_dict(keep_vars=True)
    return [key for key in state_dict if key not in own]


def restore_around_configure_sharded_model(trainer: "pl.Trainer", ckpt_path: Optional[_PATH]) -> None:
    """Load ``ckpt_path`` once, then restore from it and call ``configure_sharded_model``, in 1.6.5's order unless the
    checkpoint holds model keys that only the hook can create.

    The decision reads the checkpoint as loaded, before any ``on_load_checkpoint`` hook sees it.

    Args:
        trainer: the trainer in ``_run``, whose strategy restores before ``setup``.
        ckpt_path: the checkpoint ``_run`` restores, if any (``resume_start`` may pick an HPC checkpoint instead).
    """
    trainer._checkpoint_connector.resume_start(ckpt_path)
    unknown = keys_not_yet_in_module(trainer)
    if unknown:
        rank_zero_info(
            f"Restoring the checkpoint after `configure_sharded_model`: {len(unknown)} of its `state_dict` keys"
            f" (such as {unknown[0]!r}) are not in the LightningModule before that hook."
        )
    else:
        trainer._restore_loaded_modules_and_callbacks()
    trainer._call_configure_sharded_model()
    if unknown:
        trainer._restore_loaded_modules_and_callbacks()
