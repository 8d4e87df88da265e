"""Checkpoint errors on every rank: the ranks tell each other whether a step of saving or loading a checkpoint failed
(over the strategy's gloo checkpoint group where it has one, else its own collectives), and all raise the same
:class:`~pytorch_lightning.utilities.exceptions.CheckpointError`, which is also an instance of the original error's
type.

The hooks are ``CheckpointConnector`` (through
:class:`~pytorch_lightning.trainer.connectors.checkpoint_failures._CheckpointFailures`) and
``DDPFullyShardedStrategy`` (through
:mod:`~pytorch_lightning.strategies.fsdp_checkpoint_errors`).
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
import importlib
import math
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, NamedTuple, Optional, Tuple, Type, TYPE_CHECKING

import torch

import pytorch_lightning as pl
from pytorch_lightning.utilities.checkpoint_groups import _release_process_group
from pytorch_lightning.utilities.distributed import distributed_available
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException

if TYPE_CHECKING:
    from pytorch_lightning.utilities.collective_guard import _CollectiveGuard


_CHECKPOINT_ERROR_TYPES: Dict[Type[BaseException], Type[CheckpointError]] = {}


def _checkpoint_error_init(self: CheckpointError, message: str = "") -> None:
    # the original type's ``__init__`` may want other arguments (``UnicodeDecodeError``) or parse them (``OSError``)
    BaseException.__init__(self, message)


def _checkpoint_error_str(self: CheckpointError) -> str:
    # the original type's ``__str__`` may quote the message (``KeyError``) or read attributes that are not set
    return BaseException.__str__(self)


def _checkpoint_error_reduce(self: CheckpointError) -> Tuple[Any, ...]:
    # the class is created at runtime, so pickle rebuilds it by the original type's name instead of its own
    original = self._original_type
    return _rebuild_checkpoint_error, (original.__module__, original.__qualname__, self.args), self.__dict__


def _checkpoint_error_type(original: Type[BaseException]) -> Type[CheckpointError]:
    """The subclass of both :class:`CheckpointError` and ``original`` to raise for an error of type ``original``, or
    :class:`CheckpointError` itself where there can be no such class. Created once per type.

    Args:
        original: the type of the error that saving or loading the checkpoint raised.
    """
    original = getattr(original, "_original_type", original)
    if not issubclass(original, Exception) or issubclass(CheckpointError, original):
        return CheckpointError
    error_type = _CHECKPOINT_ERROR_TYPES.get(original)
    if error_type is None:
        namespace = {
            "__module__": CheckpointError.__module__,
            "__qualname__": f"{CheckpointError.__qualname__}[{original.__qualname__}]",
            "__init__": _checkpoint_error_init,
            "__str__": _checkpoint_error_str,
            "__reduce__": _checkpoint_error_reduce,
            "_original_type": original,
        }
        try:
            name = f"{CheckpointError.__name__}[{original.__name__}]"
            error_type = type(name, (CheckpointError, original), namespace)
            error_type("")  # some types cannot be built from a message alone (``ExceptionGroup``)
        except Exception:
            # not subclassable, a layout or metaclass conflict, or a constructor that insists on other arguments
            error_type = CheckpointError
        _CHECKPOINT_ERROR_TYPES[original] = error_type
    return error_type


def _checkpoint_error_type_named(module: str, qualname: str) -> Type[CheckpointError]:
    """:func:`_checkpoint_error_type` of the exception type ``module.qualname``, or :class:`CheckpointError` if there
    is no such importable type; used by the ranks that only know the failing rank's error by its type's name.

    Args:
        module: the ``__module__`` of the type.
        qualname: the ``__qualname__`` of the type.
    """
    try:
        original: Any = importlib.import_module(module)
        for name in qualname.split("."):
            original = getattr(original, name)
    except Exception:
        return CheckpointError
    if not isinstance(original, type) or not issubclass(original, BaseException):
        return CheckpointError
    return _checkpoint_error_type(original)


def _error_type_name(error: BaseException) -> Tuple[str, str]:
    """The module and qualified name of the type of ``error``, seen through a ``CheckpointError[...]``."""
    original = getattr(type(error), "_original_type", type(error))
    return original.__module__, original.__qualname__


def _rebuild_checkpoint_error(module: str, qualname: str, args: Tuple[Any, ...]) -> CheckpointError:
    return _checkpoint_error_type_named(module, qualname)(*args)


#: Environment variable with the number of seconds the ranks wait for each other when they exchange whether saving
#: or loading a checkpoint failed (for example while global rank 0 alone writes the file).
CHECKPOINT_TIMEOUT_ENV = "PL_CHECKPOINT_TIMEOUT"


#: Two hours: twelve times NCCL's default of ten minutes, enough to stream and ``fsync`` a checkpoint of several hundred
#: GB to a slow filesystem, and still finite, so that a rank 0 that really hangs is detected the same day.
DEFAULT_CHECKPOINT_TIMEOUT = timedelta(hours=2)


def _checkpoint_timeout() -> timedelta:
    """How long the ranks wait for each other in the checkpoint failure-flag exchange: ``PL_CHECKPOINT_TIMEOUT``
    seconds if set, else :data:`DEFAULT_CHECKPOINT_TIMEOUT`.

    Raises:
        MisconfigurationException:
            If ``PL_CHECKPOINT_TIMEOUT`` is not a positive, finite number of seconds.
    """
    return _seconds_from_env(CHECKPOINT_TIMEOUT_ENV, DEFAULT_CHECKPOINT_TIMEOUT)


#: Environment variable with the number of seconds the ranks that began a checkpoint save wait for the others to begin
#: it too, before anything else of the save (see :func:`_checkpoint_arrival_timeout`).
CHECKPOINT_ARRIVAL_TIMEOUT_ENV = "PL_CHECKPOINT_ARRIVAL_TIMEOUT"


#: Ten minutes: NCCL's default timeout. The ranks of a job on NCCL already meet at every collective within it, and
#: upstream 1.6.5's FSDP save, whose first collective was an NCCL gather, waited that long for a late rank; a rank
#: that never calls the save (``trainer.save_checkpoint`` under ``if trainer.is_global_zero:``) is named after
#: minutes instead of after ``PL_CHECKPOINT_TIMEOUT``.
DEFAULT_CHECKPOINT_ARRIVAL_TIMEOUT = timedelta(minutes=10)


def _checkpoint_arrival_timeout() -> timedelta:
    """How long the ranks that began a checkpoint save wait for the others to begin it:
    ``PL_CHECKPOINT_ARRIVAL_TIMEOUT`` seconds if set, else :data:`DEFAULT_CHECKPOINT_ARRIVAL_TIMEOUT`, and never
    longer than :func:`_checkpoint_timeout`.

    Raises:
        MisconfigurationException:
            If ``PL_CHECKPOINT_ARRIVAL_TIMEOUT`` or ``PL_CHECKPOINT_TIMEOUT`` is not a positive, finite number of
            seconds.
    """
    arrival = _seconds_from_env(CHECKPOINT_ARRIVAL_TIMEOUT_ENV, DEFAULT_CHECKPOINT_ARRIVAL_TIMEOUT)
    return min(arrival, _checkpoint_timeout())


def _not_every_rank_began(action: str, strategy_name: str, waited: timedelta, error: BaseException) -> CheckpointError:
    """The error of a rank whose agreement that every rank began a checkpoint save failed: it waited ``waited`` (or
    found the others gone), and cannot tell a rank that never calls the save from one that is late, so it names both.

    Args:
        action: the save, naming the checkpoint path.
        strategy_name: the name of the strategy's class.
        waited: how long the agreement waited at most.
        error: what the agreement raised.
    """
    seconds = f"{waited.total_seconds():g} s"
    return CheckpointError(
        f"{action} failed: not every rank began it within {seconds} (`{CHECKPOINT_ARRIVAL_TIMEOUT_ENV}`). With"
        f" `{strategy_name}`, `trainer.save_checkpoint` is a collective call: every rank must make it, not only global"
        " rank 0 (e.g. under `if trainer.is_global_zero:`), though only global rank 0 writes the file. Otherwise a"
        f" rank is more than {seconds} behind the others; if that is expected, raise"
        f" `{CHECKPOINT_ARRIVAL_TIMEOUT_ENV}`. ({_describe_error(error)})"
    )


def _seconds_from_env(name: str, default: timedelta) -> timedelta:
    """The positive, finite number of seconds in environment variable ``name``, or ``default`` if it is unset or
    blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds <= 0:
        raise MisconfigurationException(f"`{name}` must be a positive, finite number of seconds, got {value!r}.")
    return timedelta(seconds=seconds)


#: Environment variable: ``0`` lets the ranks exchange whether a checkpoint step failed over the default process
#: group, bounded by that group's own timeout, instead of over a gloo group of their own created in ``setup``.
CHECKPOINT_GLOO_GROUP_ENV = "PL_CHECKPOINT_GLOO_GROUP"


#: How long creating the gloo checkpoint group may take. The ranks then tell each other over the default process group
#: whether it worked, so this has to be well below that group's timeout (NCCL's default is ten minutes).
CHECKPOINT_GROUP_SETUP_TIMEOUT = timedelta(minutes=5)


def _checkpoint_gloo_group_wanted() -> bool:
    """Whether the checkpoint failure-flag exchange gets a gloo group of its own (``PL_CHECKPOINT_GLOO_GROUP``).

    Raises:
        MisconfigurationException:
            If ``PL_CHECKPOINT_GLOO_GROUP`` is set to anything but ``1`` or ``0``.
    """
    value = os.environ.get(CHECKPOINT_GLOO_GROUP_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise MisconfigurationException(
            f"`{CHECKPOINT_GLOO_GROUP_ENV}` must be `1` (a gloo group for checkpoint failures, the default) or `0` (the"
            f" default process group), got {value!r}."
        )
    return value != "0"


def _new_checkpoint_process_group(strategy: "pl.strategies.Strategy") -> Optional[Any]:
    """A gloo process group of all ranks whose timeout is :func:`_checkpoint_timeout`, for the checkpoint
    failure-flag exchange, or ``None`` when not running distributed or with ``PL_CHECKPOINT_GLOO_GROUP=0`` (then the
    strategy's own collectives are used, on the default process group).

    While global rank 0 alone writes a checkpoint, the other ranks wait for it in that exchange; over this group the
    wait does not depend on the default process group's timeout (NCCL's is ten minutes in most builds). Gloo connects
    the ranks over the network interface ``GLOO_SOCKET_IFNAME`` names, by default the address the host name resolves
    to, which may be one other nodes cannot reach (``127.0.1.1`` in many container images) even where NCCL works. So
    the group is created with a timeout of at most :data:`CHECKPOINT_GROUP_SETUP_TIMEOUT`, and the ranks then tell
    each other over the default group whether that worked. This is a collective call: every rank must call it, at the
    same point.

    Args:
        strategy: the strategy whose collectives tell the ranks whether creating the group failed anywhere.

    Raises:
        MisconfigurationException:
            On every rank, if creating the group failed or timed out on any rank; or if ``PL_CHECKPOINT_GLOO_GROUP`` or
            ``PL_CHECKPOINT_TIMEOUT`` is invalid.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_world_size() < 2 or not torch.distributed.is_gloo_available():
        return None
    if not _checkpoint_gloo_group_wanted():
        return None
    timeout = _checkpoint_timeout()
    # torch without ``ProcessGroup.set_timeout`` cannot lengthen the timeout afterwards: the group is created with it
    can_set_timeout = hasattr(getattr(torch.distributed, "ProcessGroup", None), "set_timeout")
    setup_timeout = min(timeout, CHECKPOINT_GROUP_SETUP_TIMEOUT) if can_set_timeout else timeout
    group, error = None, None
    try:
        group = torch.distributed.new_group(backend="gloo", timeout=setup_timeout)
        if setup_timeout != timeout:
            group.set_timeout(timeout)
    except Exception as ex:
        error = ex
    # the strategy has no checkpoint group yet: over the default group
    causes = _all_gather_objects(strategy, None if error is None else _describe_error(error))
    if all(cause is None for cause in causes):
        return group
    raise _group_setup_failed(strategy, causes) from error


def _group_setup_failed(strategy: "pl.strategies.Strategy", causes: List[Optional[str]]) -> MisconfigurationException:
    """The error of every rank where creating the gloo checkpoint group failed on the ranks with a ``cause``."""
    by_cause: Dict[str, List[int]] = {}
    for rank, cause in enumerate(causes):
        if cause is not None:
            by_cause.setdefault(cause, []).append(rank)
    failures = "; ".join(f"on global ranks {ranks}: {cause}" for cause, ranks in list(by_cause.items())[:3])
    return MisconfigurationException(
        f"`{type(strategy).__name__}` could not create the gloo process group over which the ranks tell each other"
        f" whether a checkpoint failed ({failures}). Gloo connects the"
        " ranks over the address their host name resolves to, which other nodes may not reach (`127.0.1.1` in many"
        " container images). Set `GLOO_SOCKET_IFNAME` to the network interface the nodes reach each other over (the"
        f" one `NCCL_SOCKET_IFNAME` names, if set), or set `{CHECKPOINT_GLOO_GROUP_ENV}=0` to exchange over the default"
        f" process group instead, bounded by its own timeout rather than `{CHECKPOINT_TIMEOUT_ENV}`."
    )


@contextmanager
def _catching_state_dict_hooks(
    modules: List[torch.nn.Module], failure: "_CollectiveGuard"
) -> Generator[None, None, None]:
    """Within the block, an exception of a state-dict hook of ``modules`` is recorded in ``failure`` instead of
    escaping. For FSDP units the hook is FairScale's ``_post_state_dict_hook``, the local part of each unit's gather
    (it copies the gathered tensors), so the rank goes on into the gathers of the remaining units as the other ranks
    do. Once ``failure`` is set, the hooks are skipped and the entries of their modules dropped.

    Args:
        modules: the modules whose registered state-dict hooks are wrapped.
        failure: where the first exception is recorded.
    """
    originals = [(module, dict(module._state_dict_hooks)) for module in modules]

    def catching(hook: Callable) -> Callable:
        def hook_or_record(module: torch.nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> Any:
            if not failure.failed:
                with failure.catch():
                    return hook(module, state_dict, prefix, *args)
            for key in [key for key in state_dict if key.startswith(prefix)]:
                del state_dict[key]
            return None

        hook_or_record._from_public_api = getattr(hook, "_from_public_api", False)
        return hook_or_record

    try:
        for module, hooks in originals:
            for key, hook in hooks.items():
                module._state_dict_hooks[key] = catching(hook)
        yield
    finally:
        for module, hooks in originals:
            for key, hook in hooks.items():
                if key in module._state_dict_hooks:
                    module._state_dict_hooks[key] = hook


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).rstrip('.')}"


class _ClosedCheckpointGroup(NamedTuple):
    """In place of a strategy's checkpoint group that was destroyed after a collective over it failed on this rank
    (gloo closes the connections of a collective that timed out: the group cannot be used again), until the ranks
    replace it when the next ``Trainer`` stage sets up.

    Args:
        cause: what failed, for messages.
    """

    cause: str


def _close_checkpoint_process_group(strategy: "pl.strategies.Strategy", cause: str) -> None:
    """Destroy the strategy's checkpoint group after a collective over it failed on this rank, so that the ranks still
    waiting in it, or that enter it later, fail at once instead of after its timeout; until it is replaced, a
    checkpoint collective on this rank raises :class:`CheckpointError` (see :func:`_checkpoint_process_group`)."""
    state = strategy._checkpoint_state
    try:
        _release_process_group(state, "checkpoint_group")
    except Exception:
        pass  # unusable either way
    state.checkpoint_group = _ClosedCheckpointGroup(cause)


def _checkpoint_process_group(strategy: "pl.strategies.Strategy") -> Optional[Any]:
    """The strategy's gloo checkpoint group, or ``None`` where it has none (then the default process group is used).

    Raises:
        CheckpointError: If the group was closed after a failed collective (see
            :func:`_close_checkpoint_process_group`): falling back to the default group would pair this rank's
            collectives with the others' gloo ones.
    """
    # only ``DDPFullyShardedStrategy`` makes one; the others exchange over the default group
    if not isinstance(strategy, pl.strategies.DDPFullyShardedStrategy):
        return None
    group = strategy._checkpoint_state.checkpoint_group
    if isinstance(group, _ClosedCheckpointGroup):
        raise CheckpointError(
            f"The gloo checkpoint group of this rank was closed after {group.cause}; the ranks create a new one when"
            " the next `Trainer` stage (`fit`, `validate`, ...) sets up."
        )
    return group if isinstance(group, getattr(torch.distributed, "ProcessGroup", ())) else None


def _failure_flag_buffers(
    strategy: "pl.strategies.Strategy", group: Optional[Any] = None
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The tensors of a failure-flag exchange (:func:`_exchange_flags`): this rank's flag and one per rank to
    receive them, on the CPU for a gloo group, else on the root device. A loop allocates them before its first step,
    so that its exchanges allocate nothing after a rank ran out of memory. Over the default process group they are
    the same tensors every time (see :data:`_DEFAULT_GROUP_FLAG_BUFFERS`).

    Args:
        strategy: the strategy whose ranks exchange their flags.
        group: a gloo group of all ranks to exchange over; by default the strategy's checkpoint group, or the default
            process group where it has none.
    """
    group = group if group is not None else _checkpoint_process_group(strategy)
    if group is not None:
        return _new_flag_buffers(torch.device("cpu"), torch.distributed.get_world_size(group))
    key = (strategy.root_device, torch.distributed.get_world_size())
    if key not in _DEFAULT_GROUP_FLAG_BUFFERS:
        _DEFAULT_GROUP_FLAG_BUFFERS[key] = _new_flag_buffers(*key)
    return _DEFAULT_GROUP_FLAG_BUFFERS[key]


def _new_flag_buffers(device: torch.device, world_size: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    return torch.zeros(1, dtype=torch.int32, device=device), [
        torch.zeros(1, dtype=torch.int32, device=device) for _ in range(world_size)
    ]


#: The tensors of the failure-flag exchanges over the default process group, by device and world size, kept as long as
#: the process runs. The thread of the process group that runs an exchange (gloo's worker, NCCL's watchdog) drops it
#: after the ranks have gone on; had Python freed the tensors by then, that thread would need the GIL to free them,
#: which an exiting interpreter does not give: the process aborts (see ``checkpoint_groups``, which destroys the
#: fork's own groups before the interpreter finalizes; the default group is the program's).
_DEFAULT_GROUP_FLAG_BUFFERS: Dict[Tuple[torch.device, int], Tuple[torch.Tensor, List[torch.Tensor]]] = {}


#: The flag of a rank in the final failure-flag exchange of a save or load (``_raise_on_all_ranks_if_any_failed``),
#: which follows it with a broadcast of the error; a rank that fails in the middle of a loop's steps reports ``1``.
#: A rank that sees this value in one of a loop's agreements knows the failing rank has gone on to that broadcast.
FINAL_EXCHANGE_FLAG = 2


def _exchange_flags(
    strategy: "pl.strategies.Strategy",
    flag: int,
    buffers: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None,
    group: Optional[Any] = None,
) -> List[int]:
    """Every rank's failure flag of a checkpoint step, by global rank (see :func:`_flagged_ranks`). Collective when
    more than one process runs.

    Uses the strategy's checkpoint group if it has one (a gloo group whose timeout is ``PL_CHECKPOINT_TIMEOUT``, see
    :func:`_new_checkpoint_process_group`), so that the ranks waiting here for global rank 0 to write the file do not
    depend on the default group's timeout; else the default process group.

    Args:
        strategy: the strategy whose ranks exchange their flags.
        flag: this rank's flag: ``0`` (or ``False``) if it did not fail, else ``1`` (or ``True``) or
            :data:`FINAL_EXCHANGE_FLAG`.
        buffers: the tensors to exchange over, from :func:`_failure_flag_buffers` for the same ``group``; by default
            those it returns.
        group: as for :func:`_failure_flag_buffers`.
    """
    group = group if group is not None else _checkpoint_process_group(strategy)
    torch_distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if group is None and buffers is None and not torch_distributed:
        # TPU: the strategy's own collective, as in Lightning
        flags = strategy.all_gather(torch.tensor(int(flag), device=strategy.root_device))
        return [int(value) for value in flags.reshape(-1).tolist()]
    mine, gathered = buffers if buffers is not None else _failure_flag_buffers(strategy, group)
    mine.fill_(int(flag))
    torch.distributed.all_gather(gathered, mine, group=group)
    return [int(received.item()) for received in gathered]


def _distributed_run(world_size: int) -> bool:
    """Whether ``torch.distributed`` runs this process as one of ``world_size`` > 1 ranks."""
    return world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def _flagged_ranks(flags: List[int]) -> List[int]:
    """The global ranks whose flag in ``flags`` (from :func:`_exchange_flags`) says they failed."""
    return [rank for rank, flag in enumerate(flags) if flag]


def _failed_ranks(strategy: "pl.strategies.Strategy", failed: bool) -> List[int]:
    """The global ranks that report ``failed``. Collective when more than one process runs."""
    if not distributed_available() or strategy.world_size < 2:
        return [strategy.global_rank] if failed else []
    return _flagged_ranks(_exchange_flags(strategy, failed))


def _broadcast_failure(strategy: "pl.strategies.Strategy", failure: Optional[Tuple[str, str, str]], src: int) -> Any:
    """``failure`` (the description of the error and the module and name of its type) of global rank ``src`` on every
    rank, over the group :func:`_exchange_flags` used."""
    group = _checkpoint_process_group(strategy)
    if group is None:
        return strategy.broadcast(failure, src=src)
    received = [failure]
    torch.distributed.broadcast_object_list(received, src=src, group=group)
    return received[0]


def _all_gather_objects(strategy: "pl.strategies.Strategy", obj: Any) -> List[Any]:
    """``obj`` of every rank, by global rank, over the group :func:`_exchange_flags` uses: the checkpoint
    group, whose gloo backend keeps the pickled objects in host memory. Collective."""
    group = _checkpoint_process_group(strategy)
    gathered: List[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, obj, group=group)
    return gathered
