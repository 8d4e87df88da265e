"""The one object through which ``DDPFullyShardedStrategy`` checkpoints: :class:`_FSDPCheckpointer`, made in the
strategy's ``__init__``, owns the checkpoints' state (:class:`~.fsdp_checkpoint_state._FSDPCheckpointState`) and
composes the parts, each a module of functions that take what they need (the strategy, a session, a callable)
explicitly:

- :mod:`.fsdp_introspection`: FairScale's FSDP instances, units and flat-parameter pieces;
- :mod:`.fsdp_checkpoint_errors`: the checkpoint group, the ranks' arrival, the guarded full state-dict gather;
- :mod:`.fsdp_stream_decision`: whether a save streams, and its placeholders;
- :mod:`.fsdp_streaming_save`: the streamed save (structure, then unit by unit);
- :mod:`.fsdp_parallel_save`: the streamed save's units written by every rank into the one file;
- :mod:`.fsdp_parallel_upload`: the same into one object in S3, uploaded in parts by every rank (the kinds of
  storage and their one interface: :mod:`~pytorch_lightning.utilities.checkpoint_storage`);
- :mod:`.fsdp_async_checkpoint`: the streamed save's units written in the background, the save in flight;
- :mod:`.fsdp_optimizer_state`: the consolidated optimizer state (save, re-shard on load);
- :mod:`.fsdp_restore`: the load into the sharded model;
- :mod:`.fsdp_ranged_load`: the load from object storage, each rank fetching the bytes it reads;
- :mod:`.fsdp_replicated_parameters`: the parameters outside FSDP.

The hooks are ``DDPFullyShardedStrategy``'s ``__init__`` and its call sites; the strategy's overrides are in
:mod:`.fsdp_checkpointing_strategy`.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, TYPE_CHECKING

from torch.nn import Module
from torch.optim import Optimizer

from pytorch_lightning.strategies.fsdp_async_checkpoint import (
    _close_background_saves,
    _defer_removal_while_in_flight,
    _finish_checkpoint_in_flight_alone,
    _in_flight_checkpoint_path,
    _run_once_committed,
    _wait_for_checkpoint,
    _write_streamed_units_in_background,
)
from pytorch_lightning.strategies.fsdp_checkpoint_errors import (
    _agree_on_checkpoint_arrival,
    _gather_full_state_dict,
    _setup_checkpoint_process_group,
)
from pytorch_lightning.strategies.fsdp_checkpoint_state import _FSDPCheckpointState, _SaveSession
from pytorch_lightning.strategies.fsdp_introspection import _fsdp_instances
from pytorch_lightning.strategies.fsdp_parallel_save import _plan_own_writes, _write_units_by_every_rank
from pytorch_lightning.strategies.fsdp_parallel_upload import _plan_upload, _upload_units_by_every_rank
from pytorch_lightning.strategies.fsdp_optimizer_state import (
    _check_optimizer_state_layout,
    _load_optimizer_state_dict,
    _optimizer_state,
)
from pytorch_lightning.strategies.fsdp_replicated_parameters import (
    _closure_syncing_replicated_gradients,
    _setup_replicated_parameters,
    _shared_parameters,
    _sync_replicated_gradients,
)
from pytorch_lightning.strategies.fsdp_ranged_load import _load_checkpoint_in_ranges
from pytorch_lightning.strategies.fsdp_restore import _load_model_state_dict
from pytorch_lightning.strategies.fsdp_stream_decision import (
    _begin_checkpoint_save,
    _CheckpointStream,
    _streamed_model_state_dict,
)
from pytorch_lightning.strategies.fsdp_streaming_save import _save_checkpoint_if_streamed
from pytorch_lightning.utilities.checkpoint_errors import _distributed_run
from pytorch_lightning.utilities.checkpoint_storage_kinds import (
    _scratch_checkpoint_file,
    _stage_for_sequential_copy,
    _storage_kind,
)
from pytorch_lightning.utilities.types import _PATH

if TYPE_CHECKING:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy


class _FSDPCheckpointer:
    """The checkpoints of one ``DDPFullyShardedStrategy``: each method is one step of a save, a load or a stage,
    called by the strategy.

    Args:
        strategy: the strategy whose checkpoints these are.
    """

    def __init__(self, strategy: "DDPFullyShardedStrategy") -> None:
        self._strategy = strategy
        self.state = _FSDPCheckpointState()

    # a stage

    def note_shared_parameters(self, model: Module) -> None:
        """Before ``configure_sharded_model`` wraps ``model``: which parameters its modules share."""
        self._strategy._parameters_shared_before_wrapping = _shared_parameters(model)

    def setup_process_group(self) -> None:
        _setup_checkpoint_process_group(self._strategy)

    def fsdp_instances(self) -> List["FullyShardedDataParallel"]:
        return _fsdp_instances(self._strategy.lightning_module)

    def check_optimizer_state_layout(self) -> None:
        _check_optimizer_state_layout(self._strategy)

    def setup_replicated_parameters(self) -> None:
        _setup_replicated_parameters(self._strategy)

    def open_background_saves(self) -> None:
        # a new ``Trainer.fit`` (or another stage): saves may go to the background again until its teardown
        self.state.background_closed = False

    def close_background_saves(self, teardown: Callable[[], None]) -> None:
        _close_background_saves(self._strategy, teardown)

    # training

    def closure_syncing_replicated_gradients(
        self, optimizer: Optimizer, closure: Callable[[], Any]
    ) -> Callable[[], Any]:
        return _closure_syncing_replicated_gradients(self._strategy, optimizer, closure)

    def sync_replicated_gradients(self, optimizer: Optimizer) -> None:
        _sync_replicated_gradients(self._strategy, optimizer)

    # a save

    def agree_on_arrival(self, action: str) -> None:
        _agree_on_checkpoint_arrival(self._strategy, action)

    def begin_save(self, filepath: _PATH, weights_only: bool, storage_options: Optional[Any]) -> _SaveSession:
        """The session of a save (see ``_begin_checkpoint_save``), once the save before it is committed: at most one
        is in flight, and its failure is raised before a new one starts."""
        self._strategy.wait_for_checkpoint()
        return _begin_checkpoint_save(self._strategy, filepath, weights_only, storage_options)

    def streamed_model_state_dict(self, stream: _CheckpointStream) -> Dict[str, Any]:
        return _streamed_model_state_dict(self._strategy, stream)

    def gather_full_state_dict(self, gather: Callable[[], Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        return _gather_full_state_dict(self._strategy, gather)

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        return _optimizer_state(self._strategy, optimizer)

    def save_if_streamed(self, checkpoint: Dict[str, Any], filepath: _PATH) -> bool:
        kind = _storage_kind(filepath)
        if kind != "local":
            # the object is written by every rank in parts (S3), or copied by global rank 0 from its scratch file
            # (other filesystems, and S3 with ``checkpoint_writers="rank0"``)
            write_units, plan = (
                (_upload_units_by_every_rank, _plan_upload)
                if kind == "multipart" and self._strategy.checkpoint_writers != "rank0"
                else (_write_streamed_units_in_background, _stage_for_sequential_copy)
            )
            return _save_checkpoint_if_streamed(
                self._strategy, checkpoint, filepath, write_units, plan, _scratch_checkpoint_file
            )
        if not self._every_rank_may_write():
            return _save_checkpoint_if_streamed(
                self._strategy, checkpoint, filepath, _write_streamed_units_in_background
            )
        write_units = partial(_write_units_by_every_rank, fallback=_write_streamed_units_in_background)
        return _save_checkpoint_if_streamed(self._strategy, checkpoint, filepath, write_units, _plan_own_writes)

    def _every_rank_may_write(self) -> bool:
        """Whether a streamed save's units may be written by every rank, its own shards (``checkpoint_writers``, see
        :mod:`.fsdp_parallel_save`), or by global rank 0 alone (in the background where it may). A single process
        with ``"auto"`` writes as before: nothing to probe, and no other writer to share the file with."""
        writers = self._strategy.checkpoint_writers
        return not (writers == "rank0" or (writers == "auto" and not _distributed_run(self._strategy.world_size)))

    def wait_for_checkpoint(self) -> None:
        _wait_for_checkpoint(self._strategy)

    def in_flight_path(self) -> Optional[_PATH]:
        return _in_flight_checkpoint_path(self._strategy)

    def run_once_committed(self, callback: Callable[[], None]) -> None:
        _run_once_committed(self._strategy, callback)

    def finish_in_flight_alone(self) -> None:
        _finish_checkpoint_in_flight_alone(self._strategy)

    def defer_removal(self, filepath: _PATH) -> bool:
        return _defer_removal_while_in_flight(self._strategy, filepath)

    # a load

    def load_in_ranges(self, checkpoint_path: _PATH) -> Optional[Dict[str, Any]]:
        return _load_checkpoint_in_ranges(self._strategy, checkpoint_path)

    def load_model_state_dict(
        self, checkpoint: Mapping[str, Any], load_unsharded: Callable[[Mapping[str, Any]], None]
    ) -> None:
        _load_model_state_dict(self._strategy, checkpoint, load_unsharded)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        _load_optimizer_state_dict(self._strategy, checkpoint)
