"""FairScale's own collectives in a checkpoint's per-unit loops, guarded: while a loop of ``DDPFullyShardedStrategy``
gathers FSDP units (``summon_full_params``, FairScale's ``state_dict`` and optimizer-state gathers), every collective
FairScale calls is preceded by the ranks' agreement of
:class:`~pytorch_lightning.utilities.collective_guard._CollectiveGuard`.

FairScale allocates a unit's full-parameter buffer inside ``_rebuild_full_params``, right before its all-gather. A rank
that runs out of memory there raises out of FairScale without entering the all-gather, which the other ranks are
already in; an agreement before the strategy's own call would come too early. So the agreement sits at the collective
itself: FairScale's FSDP module calls ``torch.distributed`` through its module global ``dist``, which the loops
replace, for their duration and for the thread that runs them, with :class:`_AgreeingDistributed`.

Since this reaches into FairScale's internals, the strategy's setup (and every loop) first checks that the installed
FairScale has the shape relied on (:func:`_check_fairscale_interposable`), and the replacement is refused in a second
thread and checked when it is put back.
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
import ast
import importlib.metadata
import inspect
import textwrap
import threading
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Dict, Generator, Iterable, List, Optional, Set, Tuple

import torch

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _PeerFailed
from pytorch_lightning.utilities.exceptions import MisconfigurationException

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

#: The ``torch.distributed`` collectives that an agreement precedes when FairScale calls them.
_GUARDED_COLLECTIVES = frozenset(
    {
        "all_gather",
        "_all_gather_base",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor",
        "scatter",
        "barrier",
    }
)


class _AgreeingDistributed:
    """``torch.distributed`` as FairScale's FSDP module sees it, except that in the thread ``thread`` each collective
    of :data:`_GUARDED_COLLECTIVES` over ``group`` first calls ``guard.before_collective()``, which raises instead
    where a rank cannot take part. Collectives over other groups (a unit sharded over a group of its own, such as an
    expert's) pass as they are: the ranks of such groups need not call the same number of them."""

    def __init__(self, dist: Any, guard: _CollectiveGuard, thread: int, group: Any) -> None:
        self._dist, self._guard, self._thread, self._group = dist, guard, thread, group

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._dist, name)
        if name not in _GUARDED_COLLECTIVES:
            return attribute
        return self._agreeing(name, attribute)

    def _agreeing(self, name: str, collective: Callable) -> Callable:
        def agreed_collective(*args: Any, **kwargs: Any) -> Any:
            # a training thread that runs while another thread checkpoints (none does today) is left as it was
            if threading.get_ident() == self._thread and _group_argument(name, args, kwargs) is self._group:
                self._guard.before_collective()
            return collective(*args, **kwargs)

        return agreed_collective


@lru_cache(maxsize=None)
def _collective_signature(name: str) -> inspect.Signature:
    # FairScale calls whatever its global holds as it would call ``torch.distributed``, so torch's own function says
    # where a positional ``group`` sits. It is read from ``distributed_c10d``, where torch defines it: the names in
    # ``torch.distributed`` may be replaced by a wrapper taking ``*args`` (the CPU harness's, a profiler's, a test's)
    from torch.distributed import distributed_c10d

    return inspect.signature(getattr(distributed_c10d, name, None) or getattr(torch.distributed, name))


def _group_argument(name: str, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    """The ``group`` that a call of ``torch.distributed.<name>`` with these arguments passes, keyword or positional;
    ``None`` (the default group) where it passes none."""
    if "group" in kwargs:
        return kwargs["group"]
    try:
        return _collective_signature(name).bind_partial(*args, **kwargs).arguments.get("group")
    except (TypeError, ValueError, AttributeError):  # arguments the collective rejects, or one torch lacks
        return None


class _InterposerState:
    """Which thread has FairScale's global replaced, and how deeply (a loop may nest one in its own thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: Optional[int] = None
        self.depth = 0

    def enter(self) -> None:
        with self.lock:
            if self.thread not in (None, threading.get_ident()):
                raise RuntimeError(
                    "A checkpoint's FairScale collectives are already guarded in another thread; guarding them in two"
                    " threads at once would let each replace FairScale's module global `dist` under the other. Run"
                    " the checkpoint steps of `DDPFullyShardedStrategy` from one thread at a time."
                )
            self.thread, self.depth = threading.get_ident(), self.depth + 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if not self.depth:
                self.thread = None


_INTERPOSER = _InterposerState()


@contextmanager
def _agreeing_fairscale_collectives(guard: _CollectiveGuard, group: Any) -> Generator[None, None, None]:
    """Within the block, every collective over ``group`` that FairScale's FSDP calls from this thread is preceded by
    an agreement of ``guard``.

    Args:
        guard: the guard of the loop the block runs.
        group: the FSDP process group of the units the loop gathers (FairScale passes it as ``group``).

    Raises:
        MisconfigurationException: if the installed FairScale lacks what the interposer relies on.
        RuntimeError: if another thread is inside such a block, or if something else replaced FairScale's global
            while the block ran (it is restored to what the block found).
    """
    if not _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
        yield
        return
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module

    _check_fairscale_interposable(fsdp_module)
    original = fsdp_module.dist
    proxy = _AgreeingDistributed(original, guard, threading.get_ident(), group)
    _INTERPOSER.enter()
    raised = True
    try:
        fsdp_module.dist = proxy
        yield
        raised = False
    finally:
        found = fsdp_module.dist
        fsdp_module.dist = original
        _INTERPOSER.leave()
        # only where nothing is raised already: a KeyboardInterrupt or the block's own error must go on as it is
        if found is not proxy and not raised:
            raise RuntimeError(
                f"FairScale's module global `dist` was replaced by {found!r} while a checkpoint guarded its"
                f" collectives; it is restored to {original!r}, which the guard replaced. Something else swaps"
                " `fairscale.nn.data_parallel.fully_sharded_data_parallel.dist` during a checkpoint."
            )


#: What :func:`_reset_interrupted_gathers` and :func:`_gather_units_one_at_a_time` use of an FSDP instance: methods
#: (with the parameters passed to them) and attributes that ``__init__`` sets.
_FSDP_METHODS = {
    "summon_full_params": ("recurse", "volatile"),
    "_rebuild_full_params": (),
    "_free_full_params": (),
    "_free_fp16_param_shard": (),
    "_use_fp32_param_shard": (),
}
_FSDP_INSTANCE_ATTRIBUTES = ("training_state", "mixed_precision", "move_params_to_cpu")
_TRAINING_STATES = ("IDLE", "SUMMON_FULL_PARAMS")
#: The collectives FairScale's FSDP calls through its global ``dist`` in the loops guarded here.
_CALLED_COLLECTIVES = ("all_gather", "all_reduce", "broadcast_object_list")


def _fairscale_interposer_problems(fsdp_module: Any) -> List[str]:
    """What FairScale's FSDP module (``fairscale.nn.data_parallel.fully_sharded_data_parallel``) lacks of what the
    interposer relies on, one line each: its module global ``dist`` and the collectives on it, the ``group``
    parameter of the guarded collectives, and the FSDP members read here. Empty where it has the expected shape."""
    if not hasattr(fsdp_module, "dist"):
        return ["the module global `dist` (torch.distributed as FSDP calls it), which the interposer replaces"]
    problems = [f"`dist.{name}`" for name in _CALLED_COLLECTIVES if not hasattr(fsdp_module.dist, name)]
    for name in sorted(_GUARDED_COLLECTIVES):
        if hasattr(torch.distributed, name) and "group" not in _collective_signature(name).parameters:
            problems.append(f"a `group` parameter of `torch.distributed.{name}`")
    states = getattr(fsdp_module, "TrainingState", None)
    problems += [f"`TrainingState.{state}`" for state in _TRAINING_STATES if not hasattr(states, state)]
    fsdp = getattr(fsdp_module, "FullyShardedDataParallel", None)
    if fsdp is None:
        return problems + ["the class `FullyShardedDataParallel`"]
    for method, parameters in _FSDP_METHODS.items():
        if not callable(getattr(fsdp, method, None)):
            problems.append(f"`FullyShardedDataParallel.{method}`")
            continue
        signature = inspect.signature(getattr(fsdp, method))
        missing = [p for p in parameters if p not in signature.parameters]
        problems += [f"the `{p}` parameter of `FullyShardedDataParallel.{method}`" for p in missing]
    assigned = _attributes_set_in_init(fsdp)
    missing = [a for a in _FSDP_INSTANCE_ATTRIBUTES if a not in assigned]
    return problems + [f"`FullyShardedDataParallel.{a}` (set in `__init__`)" for a in missing]


@lru_cache(maxsize=None)
def _attributes_set_in_init(cls: type) -> Set[str]:
    """The names ``cls.__init__`` assigns as ``self.<name> = ...`` (read from its source: they exist on instances
    only)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return set()
    assignments = [node for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))]
    targets = [t for node in assignments for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return {t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}


def _check_fairscale_interposable(fsdp_module: Any = None, version: Optional[str] = None) -> None:
    """Raise if FairScale's FSDP module lacks what the interposer relies on (see
    :func:`_fairscale_interposer_problems`); it checks the shape, not the version, which it only names.

    Args:
        fsdp_module: FairScale's FSDP module; the installed one by default.
        version: the FairScale version to name; the installed one by default.

    Raises:
        MisconfigurationException: naming the FairScale version and everything it lacks.
    """
    if fsdp_module is None:
        if not _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
            return  # the strategy refuses to run without FairScale already
        import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
    problems = _fairscale_interposer_problems(fsdp_module)
    if problems:
        version = version or _installed_fairscale_version()
        raise MisconfigurationException(
            f"The installed FairScale {version} lacks what `DDPFullyShardedStrategy`'s checkpoints rely on in"
            f" `{getattr(fsdp_module, '__name__', fsdp_module)}`: {'; '.join(problems)}. Install a FairScale"
            " version that `requirements/base.txt` allows and that has them (0.4.5 to 0.4.13 do)."
        )


def _installed_fairscale_version() -> str:
    try:
        return importlib.metadata.version("fairscale")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _gather_units_one_at_a_time(
    instances: List[Tuple[str, "FullyShardedDataParallel"]],
    guard: _CollectiveGuard,
    group: Any,
    work: Callable[[str, "FullyShardedDataParallel"], None],
    volatile: bool = False,
) -> None:
    """For each ``(prefix, instance)``: gather the instance's own full parameters (``summon_full_params(recurse=False)``,
    its collectives over ``group`` agreed first), run ``work(prefix, instance)`` and shard them again. An exception of
    the gather or of ``work`` is recorded in ``guard``; once any rank failed, every rank stops before the next gather.
    Collective.

    Args:
        instances: the FSDP instances, with their names in the LightningModule, in the order every rank gathers them.
        guard: the guard of the loop.
        group: the FSDP process group of the instances.
        work: this rank's local work on a gathered instance.
        volatile: as for ``summon_full_params``: ``True`` where ``work`` does not change the parameters.
    """
    with torch.no_grad(), _agreeing_fairscale_collectives(guard, group):
        for prefix, instance in instances:
            if guard.stopped:
                break
            try:
                with instance.summon_full_params(recurse=False, volatile=volatile):
                    with guard.catch():
                        work(prefix, instance)
            except _PeerFailed:
                pass
            except Exception as ex:
                guard.record(ex)
            finally:
                _reset_interrupted_gathers([instance])


def _reset_interrupted_gathers(instances: Iterable["FullyShardedDataParallel"]) -> None:
    """Leave the FSDP instances whose gather an exception interrupted as ``summon_full_params`` leaves them when it
    ends: full parameters freed, the parameters pointing at this rank's shards, ready for the next forward or gather.

    An exception raised inside FairScale's ``_rebuild_full_params`` (running out of memory while allocating the
    full-parameter buffer, or another rank's failure, see :class:`_AgreeingDistributed`) comes before the
    ``try``/``finally`` of ``summon_full_params``, which would have done this.
    """
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

    for instance in instances:
        if instance.training_state != TrainingState.SUMMON_FULL_PARAMS:
            continue
        instance._free_full_params()
        if instance.mixed_precision or instance.move_params_to_cpu:
            instance._free_fp16_param_shard()
        instance._use_fp32_param_shard()
        instance.training_state = TrainingState.IDLE
