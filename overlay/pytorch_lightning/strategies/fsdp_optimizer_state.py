"""Consolidated FSDP optimizer state: ``DDPFullyShardedStrategy`` saves the full optimizer state, gathered onto
global rank 0 one FSDP instance at a time, in FairScale's format, and re-shards it on load for any world size.

The hooks are ``DDPFullyShardedStrategy``'s ``optimizer_state`` and ``load_optimizer_state_dict`` (through its base
class and checkpointer) and ``configure_ddp``, which checks the layout.
"""
# fork-feature: fork/fsdp-consolidated-optimizer-state.patch
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TYPE_CHECKING

import torch
from torch.nn import Module
from torch.optim import Optimizer

from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.utilities.apply_func import apply_to_collection
from pytorch_lightning.strategies import fsdp_portable_optimizer_state
from pytorch_lightning.strategies.fsdp_checkpoint_errors import _new_checkpoint_guard
from pytorch_lightning.strategies.fsdp_guarded_gathers import _agreeing_fairscale_collectives
from pytorch_lightning.strategies.fsdp_introspection import (
    _flat_slice,
    _fsdp_instances,
    _outermost_fsdp_instances,
)
from pytorch_lightning.strategies.fsdp_portable_optimizer_state import (
    _fitting_optimizer_state,
    _is_rank_zero_shard,
    _load_hyperparameters_of_rank_zero_shard,
    _load_portable_optimizer_state,
    _portable_optimizer_state,
)
from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_process_group
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _gather_to_first_rank, _PeerFailed
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy
    from pytorch_lightning.strategies.fsdp_stream_decision import _CheckpointStream


def _optimizer_state_layout_of(strategy: "DDPFullyShardedStrategy") -> str:
    """How :meth:`optimizer_state` saves the optimizer state of the LightningModule.

    - ``"replicated"``: no FSDP instance, nothing is sharded; rank 0's state is the full state.
    - ``"consolidated"``: the state of the FSDP parameters is consolidated on rank 0 in FairScale's format, one
      outermost FSDP instance at a time; the state of replicated parameters is saved from rank 0. Any number of
      param groups and any parameter order work, and the checkpoint can be resumed on any number of processes.
    - ``"per_rank"``: FairScale's format needs ``flatten_parameters=True``. Without it, every rank's local state
      is saved as it is, so the checkpoint resumes exactly but only on the same number of processes.
    """
    return _optimizer_state_layout(_fsdp_instances(strategy.lightning_module))


def _check_optimizer_state_layout(strategy: "DDPFullyShardedStrategy") -> None:
    if strategy.optimizers and _optimizer_state_layout_of(strategy) == "per_rank":
        rank_zero_warn(
            "`DDPFullyShardedStrategy` can consolidate the optimizer state only with `flatten_parameters=True`."
            " Checkpoints will hold every rank's own optimizer state instead, so they can be resumed exactly,"
            " but only with the same number of processes."
        )


def _optimizer_state(strategy: "DDPFullyShardedStrategy", optimizer: Optimizer) -> Dict[str, Any]:
    """``DDPFullyShardedStrategy.optimizer_state`` (see its docstring)."""
    stream = strategy._checkpoint_state.active_stream()
    if stream is not None:
        # gathered later, while the checkpoint is written: placeholders stand for the FSDP parameters' state
        if strategy.global_rank != 0:
            return _optimizer_state_off_rank_zero(optimizer, strategy.state_dict_on_rank_0_only)
        return _streamed_optimizer_state(strategy.lightning_module, optimizer, stream)
    session = strategy._checkpoint_state.gathering_session()
    if session is not None and session.abandoned:
        # this save already failed on every rank (a rank lacks the host memory for it, or a gather failed on one,
        # see ``lightning_module_state_dict``), so none of them consolidates anything either
        return {}
    layout = _optimizer_state_layout_of(strategy)
    state = optimizer.state_dict()
    if layout == "replicated":
        return {} if strategy.state_dict_on_rank_0_only and strategy.global_rank != 0 else state
    guard = _new_checkpoint_guard(strategy)
    if layout == "per_rank":
        local_states = _gather_local_optimizer_states(strategy, state, guard)
        if strategy._checkpoint_state.abandon_if_failed(guard):
            return {}
        return local_states or _optimizer_state_off_rank_zero(optimizer, strategy.state_dict_on_rank_0_only)
    return _consolidated_optimizer_state(strategy, optimizer, state, guard)


def _consolidated_optimizer_state(
    strategy: "DDPFullyShardedStrategy", optimizer: Optimizer, state: Dict[str, Any], guard: _CollectiveGuard
) -> Dict[str, Any]:
    """The ``"consolidated"`` layout of :meth:`optimizer_state` on global rank 0 (``state`` is
    ``optimizer.state_dict()``). Collective."""
    # FairScale converts tensor ``step`` entries to ints in place; a shallow copy of each per-parameter dict
    # keeps the live optimizer state untouched (Adam needs its ``step`` to stay a tensor).
    state["state"] = {key: dict(value) for key, value in state["state"].items()}
    roots = _outermost_fsdp_instances(strategy.lightning_module)
    root_param_ids = _optimizer_root_param_ids(optimizer, roots)
    consolidated = [
        _consolidate_optimizer_state(strategy, root, _root_optimizer_state(state, param_ids), guard)
        for root, param_ids in zip(roots, root_param_ids)
    ]
    if strategy._checkpoint_state.abandon_if_failed(guard):
        # every rank stopped at the same collective: raised by ``Trainer.save_checkpoint`` on every rank
        return {}
    if strategy.global_rank != 0:
        return _optimizer_state_off_rank_zero(optimizer, strategy.state_dict_on_rank_0_only)
    return _checkpointed_optimizer_state(strategy.lightning_module, optimizer, roots, consolidated, root_param_ids)


def _consolidate_optimizer_state(
    strategy: "DDPFullyShardedStrategy",
    root: "FullyShardedDataParallel",
    state: Dict[str, Any],
    guard: _CollectiveGuard,
) -> Optional[Dict[str, Any]]:
    if guard.stopped:
        return None
    instances = _fsdp_instances(root)
    with _agreeing_fairscale_collectives(guard, root.process_group):
        try:
            if root.world_size > 1 and any(m.no_broadcast_optim_state for m in instances):
                return root.gather_full_optim_state_dict(_StateDictProvider(state))
            return _gather_full_optimizer_state(root, state, guard)
        except _PeerFailed:
            return None
        except Exception as ex:
            guard.record(ex)
            return None


def _gather_local_optimizer_states(
    strategy: "DDPFullyShardedStrategy", state: Dict[str, Any], guard: _CollectiveGuard
) -> Dict[str, Any]:
    """Every rank's local optimizer state, on the CPU of global rank 0, received one rank at a time.

    The states travel pickled, as CPU tensors, over the gloo group of all ranks that the strategy has for
    checkpoints (see ``PL_CHECKPOINT_GLOO_GROUP``): over NCCL, every pickled state would be staged in GPU memory
    and every pair of ranks would get a communicator of its own. Without that group (``PL_CHECKPOINT_GLOO_GROUP=0``)
    they go over the default process group.
    """
    local = None
    with guard.catch():
        local = apply_to_collection(state, torch.Tensor, lambda t: t.detach().cpu())
    if strategy.world_size == 1:
        return {"fsdp_per_rank": [local]} if local is not None else {}
    group = _checkpoint_process_group(strategy)
    states = [local]
    for src in range(1, strategy.world_size):
        if not guard.agree():
            return {}
        if strategy.global_rank == src:
            torch.distributed.send_object_list([local], dst=0, group=group)
        elif strategy.global_rank == 0:
            received: List[Any] = [None]
            torch.distributed.recv_object_list(received, src=src, group=group)
            states.append(received[0])
    return {"fsdp_per_rank": states} if strategy.global_rank == 0 else {}


def _load_optimizer_state_dict(strategy: "DDPFullyShardedStrategy", checkpoint: Mapping[str, Any]) -> None:
    """``DDPFullyShardedStrategy.load_optimizer_state_dict`` (see its docstring)."""
    module = strategy.lightning_module
    layout = _optimizer_state_layout_of(strategy)
    for optimizer, opt_state in zip(strategy.optimizers, checkpoint["optimizer_states"]):
        if "fsdp_per_rank" in opt_state:
            saved = opt_state["fsdp_per_rank"]
            if len(saved) != strategy.world_size:
                raise MisconfigurationException(
                    f"The checkpoint holds the optimizer state of each of {len(saved)} processes separately,"
                    " because it was saved with `flatten_parameters=False`, which FairScale cannot consolidate."
                    f" It can only be resumed with {len(saved)} processes, not {strategy.world_size}."
                )
            optimizer.load_state_dict(saved[strategy.global_rank])
        elif layout == "replicated":
            if "fsdp_roots" in opt_state or "param_id_map" in opt_state:
                raise MisconfigurationException(
                    "The checkpoint holds the optimizer state of FSDP instances, but the LightningModule has none."
                    " Wrap the model as it was wrapped when the checkpoint was saved."
                )
            optimizer.load_state_dict(_fitting_optimizer_state(module, optimizer, opt_state))
        elif layout == "per_rank" and _is_rank_zero_shard(module, optimizer, opt_state):
            _load_hyperparameters_of_rank_zero_shard(optimizer, opt_state)
        elif layout == "per_rank":
            raise MisconfigurationException(
                "The checkpoint holds the full optimizer state (saved with `flatten_parameters=True`, or by another"
                " strategy), which can only be re-sharded into FSDP instances with `flatten_parameters=True`, but"
                " the LightningModule has FSDP instances with `flatten_parameters=False`."
            )
        elif "fsdp_roots" in opt_state or "param_id_map" in opt_state:
            # the consolidated layout of fork revisions <= 80
            optimizer.load_state_dict(_reshard_optimizer_state(strategy, optimizer, opt_state))
        else:
            # the portable layout, or the optimizer state of a run without FSDP (or of Lightning 1.6.5's FSDP)
            _load_portable_optimizer_state(module, optimizer, opt_state)


def _reshard_optimizer_state(
    strategy: "DDPFullyShardedStrategy", optimizer: Optimizer, opt_state: Mapping[str, Any]
) -> Dict[str, Any]:
    """This rank's local ``optimizer.state_dict()`` from a consolidated state (see :meth:`optimizer_state`)."""
    roots = _outermost_fsdp_instances(strategy.lightning_module)
    root_param_ids = _optimizer_root_param_ids(optimizer, roots)
    if "fsdp_root_param_ids" in opt_state:
        saved_roots = opt_state["fsdp_roots"]
        saved_ids = opt_state["fsdp_root_param_ids"]
        param_groups, state = opt_state["param_groups"], dict(opt_state["state"])
    else:
        # written by earlier versions of this strategy: one param group holding exactly the flat parameters of
        # the outermost FSDP instances, one instance after the other (several of them under ``fsdp_roots``)
        saved_roots = opt_state.get("fsdp_roots", [opt_state])
        saved_ids, offset = [], 0
        for root in roots:
            count = len(list(root.parameters()))
            saved_ids.append(list(range(offset, offset + count)))
            offset += count
        param_groups, state = [dict(saved_roots[0]["param_groups"][0], params=list(range(offset)))], {}
    if len(saved_roots) != len(roots) or [list(ids) for ids in saved_ids] != root_param_ids:
        raise MisconfigurationException(
            f"The checkpoint holds the optimizer state of {len(saved_roots)} outermost FSDP instances with"
            f" flat parameters {saved_ids} (as indices into the optimizer), but the LightningModule has"
            f" {len(roots)} with {root_param_ids}. Wrap the model and create the optimizer as they were when"
            " the checkpoint was saved."
        )
    for root, saved, param_ids in zip(roots, saved_roots, saved_ids):
        for local_id, buffers in _shard_optimizer_state(root, saved)["state"].items():
            state[param_ids[local_id]] = buffers
    return {"state": state, "param_groups": param_groups}


def _optimizer_root_param_ids(
    optimizer: Optimizer, roots: List["FullyShardedDataParallel"]
) -> List[List[Optional[int]]]:
    """For each outermost FSDP instance of ``roots``, the optimizer's index (as in ``optimizer.state_dict()``) of each
    of its flat parameters, in FairScale's order, or ``None`` for a flat parameter the optimizer does not hold."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return [[index.get(id(p)) for p in root.parameters()] for root in roots]


def _optimizer_state_off_rank_zero(optimizer: Optimizer, state_dict_on_rank_0_only: bool) -> Dict[str, Any]:
    # Only global rank 0 writes the checkpoint. With ``state_dict_on_rank_0_only=False`` the other ranks keep their
    # local state in the checkpoint dict, as in Lightning 1.6.5, for hooks that read or edit it.
    return {} if state_dict_on_rank_0_only else optimizer.state_dict()


def _streamed_optimizer_state(module: Module, optimizer: Optimizer, stream: "_CheckpointStream") -> Dict[str, Any]:
    """What ``optimizer_state`` returns on global rank 0, with placeholders in ``stream`` instead of the FSDP
    parameters' optimizer state, which is gathered when the checkpoint is written."""
    roots = _outermost_fsdp_instances(module)
    state = optimizer.state_dict()
    root_param_ids = _optimizer_root_param_ids(optimizer, roots)
    index = len(stream.optimizer_states)
    consolidated = [
        _streamed_root_optimizer_state(root, _root_optimizer_state(state, ids), stream, (index, j))
        for j, (root, ids) in enumerate(zip(roots, root_param_ids))
    ]
    optimizer_state = _checkpointed_optimizer_state(module, optimizer, roots, consolidated, root_param_ids)
    stream.optimizer_states.append(optimizer_state)
    return optimizer_state


def _streamed_root_optimizer_state(
    root: "FullyShardedDataParallel", state: Dict[str, Any], stream: "_CheckpointStream", key: Tuple[int, int]
) -> Dict[str, Any]:
    """What :func:`_gather_full_optimizer_state` returns on global rank 0, built from rank 0's local ``state``
    alone: each FSDP instance's state tensors are placeholders in ``stream``, a flat one per tensor with a view per
    original parameter, as FairScale lays them out."""
    from fairscale.nn.data_parallel.fsdp_optim_utils import is_singleton_tensor

    def placeholder_entries(
        local_id: int, instance: "FullyShardedDataParallel", buffers: Dict[str, Any]
    ) -> List[Dict[str, Any]]:
        flat_param = instance.params[0]
        entries: List[Dict[str, Any]] = [{} for _ in range(instance.num_params_managed)]
        for name, value in buffers.items():
            if torch.is_tensor(value) and not is_singleton_tensor(value):
                with stream.mode:
                    flat = torch.empty(sum(flat_param._param_numels), dtype=value.dtype)
                    pieces = flat.split(flat_param._param_numels)
                    values = [piece.view(shape) for piece, shape in zip(pieces, flat_param._param_shapes)]
                stream.optimizer_placeholders[(*key, local_id, name)] = flat
            else:
                # ``step``: an int, as FairScale stores it (``_reason_checkpoint_cannot_stream`` rules out others)
                values = [value.item() if torch.is_tensor(value) else value] * len(entries)
            for entry, value in zip(entries, values):
                entry[name] = value
        return entries

    return _fairscale_optimizer_state(root, state, placeholder_entries)


def _checkpointed_optimizer_state(
    module: Module,
    optimizer: Optimizer,
    roots: List["FullyShardedDataParallel"],
    consolidated: List[Dict[str, Any]],
    root_param_ids: List[List[Optional[int]]],
) -> Dict[str, Any]:
    """What the checkpoint holds of an optimizer (see ``DDPFullyShardedStrategy.optimizer_state``), from the
    ``consolidated`` state of each outermost FSDP instance of ``roots`` in FairScale's format: the portable state (see
    :mod:`.fsdp_portable_optimizer_state`), or with ``PORTABLE_LAYOUT`` off the layout of fork revisions <= 80."""
    state = optimizer.state_dict()
    if fsdp_portable_optimizer_state.PORTABLE_LAYOUT:
        return _portable_optimizer_state(module, optimizer, state, _piece_states(roots, consolidated))
    sharded = {i for param_ids in root_param_ids for i in param_ids if i is not None}
    return {
        "state": {i: buffers for i, buffers in state["state"].items() if i not in sharded},
        "param_groups": state["param_groups"],
        "fsdp_roots": consolidated,
        "fsdp_root_param_ids": root_param_ids,
    }


def _piece_states(
    roots: List["FullyShardedDataParallel"], consolidated: List[Dict[str, Any]]
) -> Dict[Tuple[int, int], Dict[str, Any]]:
    """The state of each original parameter in the ``consolidated`` states of ``roots`` (FairScale numbers them
    over the root's FSDP instances, in the order of each flat parameter's pieces), by ``(id(flat parameter), piece)``."""
    from fairscale.nn.data_parallel import get_fsdp_instances

    pieces = {}
    for root, root_state in zip(roots, consolidated):
        global_id = 0
        for instance in get_fsdp_instances(root, skip_empty=True):
            for piece in range(instance.num_params_managed):
                if global_id in root_state["state"]:
                    pieces[(id(instance.params[0]), piece)] = root_state["state"][global_id]
                global_id += 1
    return pieces


def _optimizer_state_layout(instances: List["FullyShardedDataParallel"]) -> str:
    """How the optimizer state of a LightningModule with the FSDP instances ``instances`` is saved (see
    :func:`_optimizer_state_layout_of`)."""
    if not instances:
        return "replicated"
    return "consolidated" if all(m.flatten_parameters for m in instances) else "per_rank"


def _root_optimizer_state(state: Dict[str, Any], param_ids: List[Optional[int]]) -> Dict[str, Any]:
    """The part of ``state`` (an ``optimizer.state_dict()``) that belongs to one outermost FSDP instance, keyed by the
    local ids of its flat parameters, as FairScale expects from an optimizer built from that instance alone."""
    return {
        "state": {local_id: state["state"][i] for local_id, i in enumerate(param_ids) if i in state["state"]},
        "param_groups": [dict(state["param_groups"][0], params=list(range(len(param_ids))))],
    }


def _gather_full_optimizer_state(
    root: "FullyShardedDataParallel", state: Dict[str, Any], guard: _CollectiveGuard
) -> Optional[Dict[str, Any]]:
    """FairScale's ``gather_full_optim_state_dict``, one FSDP instance at a time.

    FairScale gathers the shards of every FSDP instance first and concatenates them afterwards, so global rank 0
    briefly holds the whole optimizer state twice. Here rank 0 concatenates each instance's shards as soon as they
    arrive and keeps views of the result, in FairScale's format (unflattened tensors, ``param_id_map``), so it
    holds the full optimizer state once plus one instance in transit. The shards are gathered to rank 0 only (see
    :func:`_gather_optim_state_to_rank_zero`). Collective; other ranks return ``None``.

    An exception of the local work of an instance on any rank (moving its state to the gather device, allocating
    the receive buffers; on rank 0 the concatenation and the views) is recorded in ``guard`` and not raised; the
    ranks agree before each gather (and, through :func:`_agreeing_fairscale_collectives`, before FairScale's own
    collectives), so once one rank failed every rank stops before the next gather, and this returns ``None``.
    """
    from fairscale.nn.data_parallel import get_fsdp_instances
    from fairscale.nn.data_parallel.fsdp_optim_utils import is_singleton_tensor

    root._lazy_init()
    for buffers in state["state"].values():
        if "step" in buffers and is_singleton_tensor(buffers["step"]):
            buffers["step"] = buffers["step"].item()  # as FairScale stores it
    if root.world_size > 1:
        pad_info = root._broadcast_pad_info_to_r0()
    else:
        pad_info = [[list(m.numel_padded_per_param) for m in get_fsdp_instances(root, skip_empty=True)]]

    def gathered_entries(
        local_id: int, instance: "FullyShardedDataParallel", buffers: Dict[str, Any]
    ) -> Optional[List[Dict[str, Any]]]:
        if guard.stopped:
            return None
        with guard.catch():
            buffers = _optimizer_state_to_gather_device(buffers, root.compute_device)
        gathered = _gather_optim_state_to_rank_zero(root, instance, local_id, buffers, guard)
        if gathered is None or root.rank != 0:
            return None
        with guard.catch():
            pads = [rank_pads[local_id][0] for rank_pads in pad_info]
            return _unflattened_entries(instance, gathered[0][local_id], gathered[1][local_id], pads)
        return None

    consolidated = _fairscale_optimizer_state(root, state, gathered_entries)
    return None if guard.stopped or root.rank != 0 else consolidated


def _fairscale_optimizer_state(
    root: "FullyShardedDataParallel",
    state: Dict[str, Any],
    unit_entries: Callable[[int, "FullyShardedDataParallel", Dict[str, Any]], Optional[List[Dict[str, Any]]]],
) -> Dict[str, Any]:
    """The optimizer state of the outermost FSDP instance ``root`` in the format of FairScale's
    ``gather_full_optim_state_dict``: one entry per original parameter (``state``, by global id), ``param_id_map``
    from global ids to the local ids of the flat parameters, and the param groups over the global ids.

    Args:
        root: the outermost FSDP instance.
        state: its part of the optimizer's state dict, by local id (see :func:`_root_optimizer_state`).
        unit_entries: for the FSDP instance of a local id with optimizer state (its ``buffers``), the entries of its
            original parameters, or ``None`` to leave them out.
    """
    from fairscale.nn.data_parallel import get_fsdp_instances

    unflat_state: Dict[int, Dict[str, Any]] = {}
    param_id_map: Dict[int, Optional[int]] = {}
    next_global_id = 0
    for local_id, instance in enumerate(get_fsdp_instances(root, skip_empty=True)):
        global_ids = list(range(next_global_id, next_global_id + instance.num_params_managed))
        next_global_id += len(global_ids)
        buffers = state["state"].get(local_id)
        param_id_map.update({global_id: None if buffers is None else local_id for global_id in global_ids})
        if buffers is None:
            continue  # a parameter without optimizer state (unused), on every rank alike
        entries = unit_entries(local_id, instance, buffers)
        if entries is not None:
            unflat_state.update(zip(global_ids, entries))
    consolidated = {key: value for key, value in state.items() if key not in ("state", "param_groups")}
    consolidated["state"] = unflat_state
    consolidated["param_groups"] = [dict(group, params=list(range(next_global_id))) for group in state["param_groups"]]
    consolidated["param_id_map"] = param_id_map
    consolidated["uncollected_local_ids"] = []
    return consolidated


def _unflattened_entries(
    instance: "FullyShardedDataParallel", tensors: Dict[str, List[Any]], singletons: Dict[str, Any], pads: List[int]
) -> List[Dict[str, Any]]:
    """The entries of the original parameters of the FSDP instance ``instance`` from every rank's shard of its state
    tensors (``tensors``, padded by ``pads``), concatenated once, as views of the result; ``singletons`` as they are."""
    entries: List[Dict[str, Any]] = [{} for _ in range(instance.num_params_managed)]
    for name, values in tensors.items():
        if not torch.is_tensor(values[0]):
            for entry in entries:
                entry[name] = values[0]
            continue
        flat = torch.cat([t[:-pad] if pad > 0 else t for t, pad in zip(values, pads)])
        for entry, view in zip(entries, instance.get_param_views([flat])):
            entry[name] = view
    for entry in entries:
        entry.update(singletons)
    return entries


def _optimizer_state_to_gather_device(buffers: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """One FSDP instance's optimizer state on ``device``, where FairScale gathers it (the compute device, also with
    ``cpu_offload``): moved here, where running out of memory can be caught, rather than inside the gather."""
    return {name: value.to(device) if torch.is_tensor(value) else value for name, value in buffers.items()}


def _gather_optim_state_to_rank_zero(
    root: "FullyShardedDataParallel",
    instance: "FullyShardedDataParallel",
    local_id: int,
    buffers: Dict[str, Any],
    guard: _CollectiveGuard,
) -> Optional[Tuple[Dict[int, Any], Dict[int, Any]]]:
    """What FairScale's ``_gather_optim_state`` returns on rank 0 of ``root``'s process group for the FSDP instance
    ``local_id`` (its every rank's state tensors, and rank 0's other values), collected with
    ``torch.distributed.gather`` instead of ``all_gather``: the other ranks never hold more than their own shard.
    Collective; the other ranks get empty dicts, and every rank ``None`` once a rank failed (see ``guard``).

    A unit sharded over a process group of its own (``instance``, which FairScale allows, e.g. for experts) is
    gathered by FairScale itself, over that group, after the agreements of
    :func:`~pytorch_lightning.strategies.fsdp_guarded_gathers._agreeing_fairscale_collectives`.
    """
    from fairscale.nn.data_parallel.fsdp_optim_utils import is_singleton_tensor

    if root.world_size == 1 or guard.stopped:
        # a rank that failed allocates nothing more: it tells the others at the next agreement
        return None if guard.stopped else _local_optim_state(local_id, buffers)
    if instance.process_group is not root.process_group:
        try:
            return root._gather_optim_state({local_id: buffers})
        except _PeerFailed:
            return None
    tensors: Dict[str, List[Any]] = {}
    singletons: Dict[str, List[Any]] = {}
    for name, value in buffers.items():
        if not torch.is_tensor(value):
            tensors[name] = [value]
            continue
        gathered = _gather_to_first_rank(value, guard, root.process_group, root.world_size)
        if gathered is None:
            return None
        if not gathered:
            continue  # not the first rank
        with guard.catch():
            if is_singleton_tensor(value):
                singletons[name] = [x.cpu().squeeze() for x in gathered]
            else:
                tensors[name] = [x.cpu() for x in gathered]
    return {local_id: tensors}, {local_id: singletons}


def _local_optim_state(local_id: int, buffers: Dict[str, Any]) -> Tuple[Dict[int, Any], Dict[int, Any]]:
    """What FairScale's ``_gather_optim_state`` returns on rank 0, for a single process, where it cannot gather."""
    from fairscale.nn.data_parallel.fsdp_optim_utils import is_singleton_tensor

    tensors: Dict[str, List[Any]] = {}
    singletons: Dict[str, List[Any]] = {}
    for name, value in buffers.items():
        if is_singleton_tensor(value):
            singletons[name] = [value.detach().to("cpu", copy=True).squeeze()]
        else:
            tensors[name] = [value.detach().cpu() if torch.is_tensor(value) else value]
    return {local_id: tensors}, {local_id: singletons}


def _shard_optimizer_state(root: "FullyShardedDataParallel", full_state: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's shard of a consolidated optimizer state, as FairScale's ``get_shard_from_optim_state_dict``
    returns it, but built without materialising any full flat tensor.

    FairScale first concatenates the unflattened tensors of every FSDP instance into full flat tensors and only then
    takes this rank's slice, so every rank briefly holds the whole optimizer state. Here each rank copies just the
    pieces of the (possibly memory-mapped) unflattened tensors that fall into its slice.
    """
    from fairscale.nn.data_parallel import get_fsdp_instances

    # FairScale's own check counts the distinct flat parameters with state, so it refuses checkpoints in which
    # several FSDP instances have none (frozen or unused); count the parameters and instances instead.
    instances = get_fsdp_instances(root, skip_empty=True)
    params = sum(m.num_params_managed for m in instances)
    local_ids = {i for i in full_state["param_id_map"].values() if i is not None}
    if len(full_state["param_id_map"]) != params or any(i >= len(instances) for i in local_ids):
        raise MisconfigurationException(
            f"The checkpoint's optimizer state covers {len(full_state['param_id_map'])} parameters in at least"
            f" {max(local_ids, default=-1) + 1} FSDP instances, but the model has {params} parameters in"
            f" {len(instances)} FSDP instances. Wrap the model as it was wrapped when the checkpoint was saved."
        )
    not_sharded = set(full_state["uncollected_local_ids"])
    by_local_id: Dict[int, List[int]] = {}
    for global_id, local_id in full_state["param_id_map"].items():
        if local_id is not None:
            by_local_id.setdefault(local_id, []).append(global_id)

    state: Dict[int, Dict[str, Any]] = {}
    for local_id, global_ids in sorted(by_local_id.items()):
        buffers = [full_state["state"][g] for g in sorted(global_ids) if g in full_state["state"]]
        if buffers:
            state[local_id] = {
                name: _shard_of_entry([b[name] for b in buffers], root, local_id in not_sharded) for name in buffers[0]
            }

    sharded = {key: value for key, value in full_state.items() if key not in ("param_id_map", "uncollected_local_ids")}
    sharded["state"] = state
    params = list(range(len(by_local_id)))
    sharded["param_groups"] = [dict(group, params=params) for group in full_state["param_groups"]]
    return sharded


def _shard_of_entry(values: List[Any], root: "FullyShardedDataParallel", not_sharded: bool) -> Any:
    """This rank's part of one entry (e.g. ``exp_avg``) of a flat parameter's optimizer state, from its ``values`` for
    each of the flat parameter's original parameters."""
    from fairscale.nn.data_parallel.fsdp_optim_utils import is_singleton_tensor

    if is_singleton_tensor(values[-1]):
        return values[-1]
    if isinstance(values[-1], list) and values[-1] and is_singleton_tensor(values[-1][0]):
        # one entry per rank that saved it; a larger world size takes the first one
        per_rank = values[-1]
        return per_rank[0] if root.rank >= len(per_rank) else per_rank[root.rank]
    if torch.is_tensor(values[-1]):
        # not sharded: the whole flat tensor, as the one shard of a world of one
        return _flat_slice(values, 0, 1) if not_sharded else _flat_slice(values, root.rank, root.world_size)
    # a non-tensor entry (e.g. an int ``step``) is the same for all parameters of one flat parameter
    return values[-1]


class _StateDictProvider:
    """Hands a precomputed optimizer state dict to FairScale, which only calls ``state_dict()`` on the optimizer."""

    def __init__(self, state: Dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> Dict[str, Any]:
        return self._state
