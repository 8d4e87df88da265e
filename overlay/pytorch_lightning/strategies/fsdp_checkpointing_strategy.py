"""The one fork base class of ``DDPFullyShardedStrategy``: the strategy methods the fork overrides or adds, each
handing the work to the strategy's :class:`~.fsdp_checkpointer._FSDPCheckpointer` in a few lines.

The hook is ``DDPFullyShardedStrategy``'s base class; ``__init__`` makes the checkpointer.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
from typing import Any, Callable, Dict, Mapping, Optional, Type, Union

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import pytorch_lightning as pl
from pytorch_lightning.strategies.ddp import DDPStrategy
from pytorch_lightning.strategies.fsdp_checkpoint_state import _FSDPCheckpointState
from pytorch_lightning.strategies.fsdp_checkpointer import _FSDPCheckpointer
from pytorch_lightning.utilities.types import _PATH


class _FSDPCheckpointingStrategy(DDPStrategy):
    """``DDPStrategy`` whose checkpoints, optimizer steps and stages go through ``self._checkpointer``."""

    _checkpointer: _FSDPCheckpointer

    @property
    def _checkpoint_state(self) -> _FSDPCheckpointState:
        """The checkpoints' state, which the checkpointer owns."""
        return self._checkpointer.state

    @property
    def _fully_sharded_class(self) -> Type["_FSDPCheckpointingStrategy"]:
        """``DDPFullyShardedStrategy``, the class deriving from this one, which a user's subclass overrides: the
        parts are given it here, through the strategy, because ``fully_sharded.py`` imports them (through the
        checkpointer) and none of them may import it back."""
        return next(cls for cls in type(self).__mro__ if _FSDPCheckpointingStrategy in cls.__bases__)

    @override
    def connect(self, model: Module) -> None:
        """Called by the Trainer to connect the strategy with the model; also notes which parameters the model's
        modules share, before ``configure_sharded_model`` wraps them.

        Args:
            model: the LightningModule
        """
        self._checkpointer.note_shared_parameters(model)
        super().connect(model)

    @override
    def setup_environment(self) -> None:
        self._checkpointer.open_background_saves()
        super().setup_environment()

    @override
    def teardown(self) -> None:
        self._checkpointer.close_background_saves(super().teardown)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        opt_idx: int,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Performs the actual optimizer step, averaging the gradients of replicated parameters (see
        :meth:`sync_replicated_gradients`) after ``closure`` ran the backward pass.

        Args:
            optimizer: the optimizer performing the step
            opt_idx: index of the current optimizer
            closure: closure calculating the loss value
            model: reference to the model, optionally defining optimizer step related hooks
            **kwargs: Any extra arguments to ``optimizer.step``
        """
        closure = self._checkpointer.closure_syncing_replicated_gradients(optimizer, closure)
        return super().optimizer_step(optimizer, opt_idx, closure, model, **kwargs)

    def sync_replicated_gradients(self, optimizer: Optimizer) -> None:
        """Average the gradients of the replicated parameters of ``optimizer`` over the ranks.

        FSDP reduces the gradients of the parameters it manages during the backward pass; the LightningModule's
        other trainable parameters (outside every FSDP instance) would otherwise train a different copy on every rank.
        With automatic optimization this runs once per optimizer step, after the backward pass of the last
        accumulated batch and before gradient clipping. With manual optimization it runs in ``optimizer.step()``;
        if you clip gradients yourself, call it before clipping. Calling it twice does no harm. Unlike DDP's, the
        averaging happens after ``on_after_backward``, which sees each rank's own gradients. This is a collective
        call: all ranks must call it.

        Args:
            optimizer: the optimizer whose replicated parameters are synchronised.
        """
        self._checkpointer.sync_replicated_gradients(optimizer)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """Returns the full state of ``optimizer`` on global rank 0, and an empty dict elsewhere.

        Each rank holds the optimizer state of its own shard of the FSDP parameters only. The shards are gathered
        onto global rank 0 one FSDP instance at a time, so no other rank ever holds the full optimizer state. This
        is a collective call: all ranks must call it.

        The checkpoint holds the state a run of the same LightningModule without FSDP saves (the optimizer's
        ``state_dict()`` over the original parameters, in the plain model's order), plus ``"param_names"``, each
        index's parameter name, so that it resumes under any strategy and world size (see
        :mod:`~pytorch_lightning.strategies.fsdp_portable_optimizer_state`). With ``flatten_parameters=False``
        every rank's local state is saved under ``"fsdp_per_rank"`` instead (see ``_optimizer_state_layout``). A
        LightningModule without FSDP instances saves its optimizer state as is.

        Args:
            optimizer: the optimizer whose state is saved.
        """
        return self._checkpointer.optimizer_state(optimizer)

    def wait_for_checkpoint(self) -> None:
        """Returns once the checkpoint being saved in the background (``async_checkpoint=True``) is committed, at
        once if none is. This is a collective call: all ranks must call it.

        ``Trainer.save_checkpoint`` calls it before each save (so at most one is in flight), ``Trainer.fit`` at its end,
        and a load before it reads a checkpoint. Files that ``ModelCheckpoint`` removed while the save was in flight
        (``save_top_k``, ``save_last``) are removed now, once their successor is on disk.

        Raises:
            CheckpointError: on every rank, if the save failed on any rank; the previous file at its path is intact.
        """
        self._checkpointer.wait_for_checkpoint()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if not self._checkpointer.defer_removal(filepath):
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        self.wait_for_checkpoint()
        loaded = self._checkpointer.load_in_ranges(*args, **kwargs)
        return loaded if loaded is not None else super().load_checkpoint(*args, **kwargs)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore the checkpoint after :meth:`setup`, once ``configure_sharded_model`` has created and wrapped the
        layers, so that the state dict keys of a model built there match those in the checkpoint."""
        return True

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads the full (unsharded) model state from the checkpoint into the sharded model.

        The FSDP instances are gathered one at a time (``summon_full_params(recurse=False)``), their own parameters
        are copied from the checkpoint, and each rank keeps only its shard afterwards, so no rank ever holds more
        than one gathered unit. Parameters outside FSDP and all buffers are loaded by ``load_state_dict``. Missing
        and unexpected keys raise, as a strict ``load_state_dict`` does. This is a collective call: all ranks must
        call it. If gathering or copying a unit fails on a rank, every rank stops before the next gather: the failing
        rank raises its error, the others an error that names it.

        Lightning 1.6.5 restored checkpoints before ``configure_sharded_model``, so LightningModules re-create their
        unwrapped layers in ``on_load_checkpoint`` to load the full state dict into them. If that hook replaced
        modules that ``configure_sharded_model`` had wrapped, the new layers are sharded first:
        ``configure_sharded_model`` runs again, and the optimizers are created anew for the new parameters.

        Args:
            checkpoint: the loaded checkpoint, whose ``"state_dict"`` holds the full model state.
        """
        self._checkpointer.load_model_state_dict(checkpoint, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads each rank's part of the optimizer state saved by :meth:`optimizer_state`.

        The state saved by :meth:`optimizer_state`, or by a run of the same LightningModule on another strategy
        (a single device, DDP), is re-sharded into the FSDP flat parameters for the current world size, which may
        differ from the one it was saved with; so is the consolidated state of fork revisions <= 80. A per-rank
        state (``flatten_parameters=False``) needs the same world size. The state is placed on the device of its
        parameter, so FSDP's ``cpu_offload`` keeps it on the CPU.

        Checkpoints written by Lightning <= 1.6.5 hold only global rank 0's shard of the optimizer state (told apart
        by their counts and shapes). Their per-parameter state (e.g. Adam's moments, SGD's momentum) cannot be
        restored and is left freshly initialized, with a warning; the param group hyperparameters (e.g. the
        learning rate) are restored.

        Args:
            checkpoint: the loaded checkpoint, whose ``"optimizer_states"`` hold what :meth:`optimizer_state` saved.

        Raises:
            MisconfigurationException:
                If the checkpoint's optimizer state does not fit the LightningModule's parameters, param groups, FSDP
                layout or processes; the message names the first mismatch.
        """
        self._checkpointer.load_optimizer_state_dict(checkpoint)
