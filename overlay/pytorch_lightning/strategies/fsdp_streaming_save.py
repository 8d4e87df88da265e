"""The streamed FSDP save: global rank 0 writes the checkpoint's structure, then every rank gathers the FSDP units
and their optimizer state one at a time while rank 0 writes each into its place in the file, so that rank 0 holds
about one unit instead of the whole checkpoint.

The hook is ``DDPFullyShardedStrategy.save_checkpoint``, which calls :func:`_save_checkpoint_if_streamed` through
the strategy's checkpointer.
"""

# fork-feature: fork/fsdp-streaming-save.patch
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TYPE_CHECKING

import torch
from torch.optim import Optimizer

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.fsdp_guarded_gathers import _gather_units_one_at_a_time
from pytorch_lightning.strategies.fsdp_checkpoint_errors import _new_checkpoint_guard
from pytorch_lightning.strategies.fsdp_optimizer_state import _optimizer_root_param_ids, _root_optimizer_state
from pytorch_lightning.strategies.fsdp_introspection import (
    _named_fsdp_instances,
    _outermost_fsdp_instances,
    _own_parameters,
)
from pytorch_lightning.strategies.fsdp_checkpoint_state import _SaveSession
from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream
from pytorch_lightning.utilities.checkpoint_errors import _broadcast_failure, _failed_ranks
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _gather_to_first_rank
from pytorch_lightning.utilities.rank_zero import rank_zero_info
from pytorch_lightning.utilities.streamed_checkpoint_file import (
    _committed_if_complete,
    _NotStreamable,
    _StreamedCheckpointFile,
)
from pytorch_lightning.utilities.types import _PATH

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

#: What writes a streamed save's units into the file once its structure is written.
_UnitsWriter = Callable[["DDPFullyShardedStrategy", "_CheckpointStream", Optional[_StreamedCheckpointFile]], None]
#: What global rank 0 prepares for the units' writers once it wrote the structure (``_CheckpointStream.plan``): an
#: object whose ``discard()`` undoes what it left on disk, called where the save stops before the units are written.
_UnitsPlanner = Callable[["DDPFullyShardedStrategy", "_CheckpointStream", _StreamedCheckpointFile], Any]


def _save_checkpoint_if_streamed(
    strategy: "DDPFullyShardedStrategy",
    checkpoint: Dict[str, Any],
    filepath: _PATH,
    write_units: "_UnitsWriter",
    plan_units: Optional[_UnitsPlanner] = None,
    open_file: Callable[[_PATH], _StreamedCheckpointFile] = _StreamedCheckpointFile,
) -> bool:
    """Write ``checkpoint`` while gathering the state its placeholders stand for, if this save was prepared to
    stream (see ``stream_checkpoint``), and return whether it was. Collective then.

    ``write_units`` writes the units once the structure is written: :func:`_write_streamed_units`, or the background
    save's (see :mod:`~pytorch_lightning.strategies.fsdp_async_checkpoint`), or every rank's (see
    :mod:`~pytorch_lightning.strategies.fsdp_parallel_save`), which ``plan_units`` prepares on global rank 0 once
    the structure is written: its result reaches every rank as ``stream.plan``, with rank 0's decision. Global rank 0
    writes into ``open_file(filepath)`` (a scratch file, for object storage)."""
    session = strategy._checkpoint_state.session
    stream = None if session is None else session.stream
    if session is not None:
        session.stream = None  # the placeholders are written once
    if stream is None or not stream.started or checkpoint.get("state_dict") is not stream.model_state_dict:
        return False
    # global rank 0 writes the checkpoint's structure, then every rank gathers the FSDP units and their optimizer
    # state one at a time while rank 0 writes each into its place. The file appears at ``filepath`` only if every
    # rank succeeded; a failure on any rank leaves the previous file untouched and is raised on that rank
    # (``Trainer.save_checkpoint`` then raises it on every rank)
    streams, writer = _write_streamed_skeleton(strategy, checkpoint, filepath, stream, session, plan_units, open_file)
    if streams:
        write_units(strategy, stream, writer)
    return True


def _write_streamed_skeleton(
    strategy: "DDPFullyShardedStrategy", checkpoint: Dict[str, Any], filepath: _PATH, stream: "_CheckpointStream",
    session: _SaveSession, plan_units: Optional[_UnitsPlanner] = None,
    open_file: Callable[[_PATH], _StreamedCheckpointFile] = _StreamedCheckpointFile,
) -> Tuple[bool, Optional[_StreamedCheckpointFile]]:
    """Global rank 0 writes the checkpoint's structure into a new temporary file (see
    :meth:`_StreamedCheckpointFile.write_skeleton`) and, with ``plan_units``, prepares the units' writers
    (``stream.plan``); the ranks learn whether it did, and its plan, in one broadcast. Collective.

    Returns whether the units are to be streamed into the file, and on global rank 0 the file. Otherwise the
    checkpoint was saved whole (where it cannot be streamed, with a log line saying why), or it failed, which is
    raised on global rank 0."""
    writer, error, decision = None, None, "stream"
    if strategy.is_global_zero:
        try:
            writer = open_file(filepath)
            writer.write_skeleton(checkpoint, stream.placeholders())
            if plan_units is not None:
                stream.plan = plan_units(strategy, stream, writer)
        except _NotStreamable as ex:
            decision = f"whole: {ex}"
        except Exception as ex:
            error, decision = ex, "failed"
        if decision != "stream" and writer is not None:
            writer.discard()
    # over the checkpoint group, so that the other ranks wait for rank 0 as long as `PL_CHECKPOINT_TIMEOUT` says
    try:
        decision, stream.plan = _broadcast_failure(strategy, (decision, stream.plan), src=0)
    except BaseException:
        if writer is not None:
            # a rank was lost while rank 0 wrote the structure: no temporary file is left
            if stream.plan is not None:
                stream.plan.discard()
            writer.discard()
        raise
    if decision == "failed":
        if error is not None:
            raise error
        return False, None
    if decision != "stream":
        rank_zero_info(
            "`DDPFullyShardedStrategy`: the checkpoint is gathered on global rank 0 before it is written, not"
            f" streamed, because {decision[len('whole: ') :]}."
        )
        _save_checkpoint_gathered(strategy, checkpoint, filepath, stream, session)
        return False, None
    return True, writer


def _write_streamed_units(
    strategy: "DDPFullyShardedStrategy", stream: "_CheckpointStream", writer: Optional[_StreamedCheckpointFile]
) -> None:
    """Every rank gathers the FSDP units and their optimizer state one at a time while global rank 0 writes each
    into its place in ``writer``, then commits it if every rank succeeded. Collective."""
    # before each gather of a unit, the ranks agree over the checkpoint group that all of them can take part, so
    # that a failure on one rank (in FairScale's allocation of the unit's buffers too) stops every rank there;
    # the other ranks also wait for rank 0's writes there, for as long as ``PL_CHECKPOINT_TIMEOUT`` says
    guard = _new_checkpoint_guard(strategy)
    with _committed_if_complete(writer):
        _stream_model_state(strategy, stream, writer, guard)
        if not stream.weights_only:
            for index, optimizer in enumerate(strategy.optimizers):
                _stream_optimizer_state(strategy, optimizer, index, stream, writer, guard)
        if not guard.settle() and writer is not None:
            writer.complete = True
    guard.raise_if_failed()


def _save_checkpoint_gathered(
    strategy: "DDPFullyShardedStrategy", checkpoint: Dict[str, Any], filepath: _PATH, stream: "_CheckpointStream",
    session: _SaveSession,
) -> None:
    """Gather the state the placeholders of ``stream`` stand for, put it in their place and save the checkpoint
    as a whole, as without ``stream_checkpoint``. Collective."""
    with session.gathering_state():
        state_dict = strategy.lightning_module_state_dict()
        optimizer_states = [] if stream.weights_only else [strategy.optimizer_state(o) for o in strategy.optimizers]
    error = session.pop_error()
    if _failed_ranks(strategy, error is not None):
        if error is not None:
            raise error
        return
    if checkpoint.get("state_dict") is stream.model_state_dict:
        checkpoint["state_dict"] = state_dict
    saved = checkpoint.get("optimizer_states", [])
    for i, (placeholder, state) in enumerate(zip(stream.optimizer_states, optimizer_states)):
        if i < len(saved) and saved[i] is placeholder:
            saved[i] = state
    if strategy.is_global_zero:
        strategy.checkpoint_io.save_checkpoint(checkpoint, filepath)


def _stream_model_state(
    strategy: "DDPFullyShardedStrategy", stream: "_CheckpointStream", writer: Optional[Any], guard: _CollectiveGuard
) -> None:
    """Gather the FSDP instances one at a time (``summon_full_params(recurse=False)``), and on global rank 0
    write each parameter into its placeholder's place in the file. Stops on every rank once any rank failed."""
    written = set()
    module = strategy.lightning_module
    instances = _named_fsdp_instances(module)

    def write(prefix: str, instance: "FullyShardedDataParallel") -> None:
        if writer is not None:
            written.update(_write_unit(prefix, instance, stream, writer))

    _gather_units_one_at_a_time(instances, guard, strategy._process_group, write, volatile=True)
    if writer is not None and not guard.stopped and written != set(stream.model):
        guard.record(
            RuntimeError(
                f"The FSDP instances gave no values for {sorted(set(stream.model) - written)} of the checkpoint."
            )
        )


def _stream_optimizer_state(
    strategy: "DDPFullyShardedStrategy",
    optimizer: Optimizer,
    index: int,
    stream: "_CheckpointStream",
    writer: Optional[Any],
    guard: _CollectiveGuard,
) -> None:
    """Gather each FSDP instance's optimizer state onto global rank 0 (``torch.distributed.gather``, so the
    other ranks only ever hold their own shard), one state tensor at a time, and write it into its placeholder's
    place in the file there. Every allocation comes before the agreement that precedes its gather."""
    roots = _outermost_fsdp_instances(strategy.lightning_module)
    for root, key, value, numel in _streamed_optimizer_tensors(optimizer, index, roots):
        if guard.stopped:
            return
        shard = None
        with guard.catch():
            shard = value.to(root.compute_device).reshape(-1)
        shards = _gather_to_first_rank(shard, guard, root.process_group, root.world_size)
        if shards is None:
            return
        if writer is None:
            continue
        with guard.catch():
            writer.write_shards(stream.optimizer_placeholders[key], shards, numel)


def _streamed_optimizer_tensors(
    optimizer: Optimizer, index: int, roots: List["FullyShardedDataParallel"]
) -> Iterator[Tuple["FullyShardedDataParallel", Tuple[Any, ...], torch.Tensor, int]]:
    """The optimizer state tensors of the FSDP instances (under the outermost ones, ``roots``) that a streamed save
    gathers, in the order of the placeholders: the outermost instance, the key of the placeholder, this rank's shard of
    the state tensor and the number of elements of the unpadded flat parameter."""
    from fairscale.nn.data_parallel import get_fsdp_instances
    from fairscale.nn.data_parallel.fsdp_optim_utils import is_singleton_tensor

    state = optimizer.state_dict()
    for j, (root, param_ids) in enumerate(zip(roots, _optimizer_root_param_ids(optimizer, roots))):
        local = _root_optimizer_state(state, param_ids)["state"]
        for local_id, instance in enumerate(get_fsdp_instances(root, skip_empty=True)):
            numel = sum(instance.params[0]._param_numels)
            for name, value in local.get(local_id, {}).items():
                if torch.is_tensor(value) and not is_singleton_tensor(value):
                    yield root, (index, j, local_id, name), value, numel


def _write_unit(
    prefix: str, instance: "FullyShardedDataParallel", stream: "_CheckpointStream", writer: Any
) -> List[str]:
    """Write the gathered parameters of the FSDP instance ``instance`` (not those of the instances inside it)
    into their placeholders' places; returns their keys."""
    written = []
    for key, param in _own_parameters(prefix, instance):
        placeholder = stream.model.get(key)
        if placeholder is None or (placeholder.shape, placeholder.dtype) != (param.shape, param.dtype):
            raise RuntimeError(
                f"The gathered parameter {key!r} ({tuple(param.shape)}, {param.dtype}) has no matching entry in"
                " the checkpoint being streamed."
            )
        writer.write(placeholder, param)
        written.append(key)
    return written
