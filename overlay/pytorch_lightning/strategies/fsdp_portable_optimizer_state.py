"""The portable optimizer state: ``DDPFullyShardedStrategy`` saves the optimizer state that a run of the same
LightningModule without FSDP would save, so that the file resumes under any strategy, and loads such a state (from
either) into its flat parameters, for any world size.

FairScale flattens the parameters of each FSDP unit into one flat parameter, so the optimizer of an FSDP run holds
one state per unit. The checkpoint holds one per original parameter instead, in the plain model's order (recovered
from the wrapped module tree: FSDP's own order differs, the root unit's flat parameter comes first):

- ``"state"`` and ``"param_groups"`` are ``optimizer.state_dict()`` of the plain model's optimizer, so
  ``Optimizer.load_state_dict`` loads them as they are (a single device, DDP, Lightning 2.x);
- ``"param_names"`` names each index (the LightningModule's state-dict key), for loaders that key the state by name
  (torch's ``set_optimizer_state_dict``, see :mod:`pytorch_lightning.utilities.named_optimizer_state`).

The state tensors of one FSDP unit stay views into one record per state key, so the file is written streamed, at the
same memory as before. FairScale puts one ``requires_grad`` and one dtype in each flat parameter, so under FSDP a
param group holds whole units: a plain run's group that splits a unit cannot be restored, and raises.

The hooks are ``DDPFullyShardedStrategy.optimizer_state`` and ``load_optimizer_state_dict`` (through the fork's
:mod:`.fsdp_optimizer_state`) and ``Strategy.load_optimizer_state_dict``, which checks that a state fits before the
optimizer loads it.
"""
# fork-feature: fork/portable-optimizer-state.patch
import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch.nn import Module
from torch.optim import Optimizer

from pytorch_lightning.strategies.fsdp_introspection import (
    _clean_fsdp_key,
    _flat_parameter_pieces,
    _flat_slice,
    _fsdp_instances,
)
from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_error_type
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

#: Whether FSDP saves write the portable layout. ``False`` only in the checkpoint-memory benchmark, which measures
#: the consolidated layout of fork revisions <= 80 (FairScale's, per FSDP root) side by side with it.
PORTABLE_LAYOUT = True

#: The keys of the optimizer-state layouts that only ``DDPFullyShardedStrategy`` reads (fork revisions <= 80).
_FSDP_ONLY_KEYS = ("fsdp_roots", "param_id_map", "fsdp_per_rank")

#: Where a plain parameter lives in the wrapped model: ``("piece", id(flat parameter), index of the piece)`` or
#: ``("param", id(parameter))`` for one outside FSDP.
_Source = Tuple[Any, ...]


@dataclass(frozen=True)
class _PlainParameter:
    """A parameter of the LightningModule as a run without FSDP has it: its state-dict key and shape."""

    name: str
    shape: torch.Size
    source: _Source


@dataclass
class _PortableLayout:
    """How one optimizer's state maps between the plain model and the optimizer's own parameters.

    Args:
        parameters: the plain parameters by portable index.
        groups: for each param group, its portable indices.
        members: for each param group, each of the optimizer's parameters in it (by its index in
            ``optimizer.state_dict()``) with the portable indices it holds: several for a flat parameter.
    """

    parameters: List[_PlainParameter]
    groups: List[List[int]]
    members: List[List[Tuple[int, List[int]]]]


def _plain_parameters(module: Module) -> List[_PlainParameter]:
    """The parameters of ``module`` as ``module.named_parameters()`` lists them without FSDP: in the order of its
    module tree, each once (a weight tied inside an FSDP unit is one piece of its flat parameter)."""
    instances = _fsdp_instances(module)
    pieces = _flat_parameter_pieces(instances)
    flat_ids = {id(flat) for instance in instances for flat in instance.params}
    plain: List[_PlainParameter] = []
    seen = set()
    for module_name, submodule in module.named_modules():
        prefix = _clean_fsdp_key(module_name)
        named = [(name, shape, ("piece", *source)) for name, shape, _, source in pieces.get(id(submodule), [])]
        named += [
            (name, param.shape, ("param", id(param)))
            for name, param in submodule.named_parameters(recurse=False)
            if id(param) not in flat_ids
        ]
        for name, shape, source in named:
            if source not in seen:
                seen.add(source)
                plain.append(_PlainParameter(f"{prefix}.{name}" if prefix else name, shape, source))
    return plain


def _portable_layout(module: Module, optimizer: Optimizer) -> _PortableLayout:
    """The layout of ``optimizer``'s portable state for ``module``: under FSDP a flat parameter stands for the
    original parameters it holds.

    A plain run lists a group's parameters as the user's code does, e.g. ``self.parameters()`` or
    ``list(self.decoder.parameters()) + list(self.encoder.parameters())``. Under FSDP the same code lists each unit's
    flat parameter before those of the units nested in it, whose original parameters interleave in the plain order.
    So each such run (a unit followed by units nested in it) is put in the plain model's order, and the runs keep the
    group's order.
    """
    plain = _plain_parameters(module)
    position = {p.source: k for k, p in enumerate(plain)}
    instance_of = {id(flat): instance for instance in _fsdp_instances(module) for flat in instance.params}
    members: List[List[Tuple[int, List[int]]]] = []
    order: List[int] = []
    groups: List[List[int]] = []
    index = 0
    for group in optimizer.param_groups:
        entries, runs = [], []
        run_top: Optional[Module] = None
        for param in group["params"]:
            instance = instance_of.get(id(param))
            if instance is not None:
                sources = [("piece", id(param), i) for i in range(len(param._param_infos))]
            else:
                sources = [("param", id(param))]
            if any(source not in position for source in sources):
                raise MisconfigurationException(
                    f"The optimizer `{type(optimizer).__name__}` holds a parameter of shape {tuple(param.shape)} that"
                    " is not a parameter of the LightningModule, so its state cannot be saved under a name."
                )
            positions = [position[source] for source in sources]
            entries.append((index, positions))
            index += 1
            if instance is not None and run_top is not None and _is_nested_in(instance, run_top):
                runs[-1].extend(positions)
            else:
                runs.append(list(positions))
                run_top = instance
        members.append(entries)
        start = len(order)
        order.extend(k for run in runs for k in sorted(run))
        groups.append(list(range(start, len(order))))
    portable_index = {k: i for i, k in enumerate(order)}
    return _PortableLayout(
        parameters=[plain[k] for k in order],
        groups=groups,
        members=[[(j, [portable_index[k] for k in ks]) for j, ks in entries] for entries in members],
    )


def _is_nested_in(instance: Module, outer: Module) -> bool:
    return instance is not outer and any(m is instance for m in outer.modules())


#: State keys that torch's optimizers keep as one 0-d value per parameter, not one per element: they are shared by
#: the pieces of a flat parameter. Only needed for a unit whose parameters are all 0-d, where shapes cannot tell.
_SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def _is_param_shaped(value: Any) -> bool:
    """Whether an entry of a parameter's optimizer state is a tensor with elements (FairScale's rule: every tensor
    that is not 0-d), as opposed to a value shared by a flat parameter's pieces."""
    return torch.is_tensor(value) and value.dim() > 0


def _elementwise_keys(pieces: Sequence[Optional[Mapping[str, Any]]]) -> Set[str]:
    """The state keys with one value per element of the original parameters ``pieces`` of one flat parameter hold
    (``None`` for a piece without state): those with a tensor with elements in any piece; a 0-d parameter's are 0-d."""
    keys = {key for piece in pieces if piece for key, value in piece.items() if _is_param_shaped(value)}
    if not keys:
        # every parameter of the unit is 0-d (e.g. temperatures): torch's per-element state is then 0-d too
        keys = {
            key
            for piece in pieces
            if piece
            for key, value in piece.items()
            if torch.is_tensor(value) and key not in _SCALAR_STATE_KEYS
        }
    return keys


def _own_copy(value: Any) -> Any:
    # each plain parameter gets its own ``step``: torch's Adam increments it in place
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def _portable_optimizer_state(
    module: Module, optimizer: Optimizer, state: Dict[str, Any], pieces: Mapping[Tuple[int, int], Dict[str, Any]]
) -> Dict[str, Any]:
    """The portable state of ``optimizer`` (see the module docstring) on global rank 0.

    Args:
        module: the LightningModule.
        optimizer: its optimizer.
        state: ``optimizer.state_dict()``: the state of the parameters outside FSDP, the groups' hyperparameters and
            each flat parameter's values shared by its pieces (``step``).
        pieces: the full (gathered, or placeholder) state of each piece of a flat parameter with state, by
            ``(id(flat parameter), index of the piece)``: tensors shaped like the original parameter.
    """
    layout = _portable_layout(module, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    portable: Dict[int, Dict[str, Any]] = {}
    for entries in layout.members:
        for j, indices in entries:
            local = state["state"].get(j)
            if local is None:
                continue  # no state (frozen or unused), as in a plain run
            if len(indices) == 1 and layout.parameters[indices[0]].source[0] == "param":
                portable[indices[0]] = local
                continue
            # the flat parameter's own state tells which keys are per element (1-d) and which shared (``step``)
            shared = {key: value for key, value in local.items() if not _is_param_shaped(value)}
            for piece, i in enumerate(indices):
                entry = {key: value for key, value in pieces[(id(params[j]), piece)].items() if key not in shared}
                entry.update({key: _own_copy(value) for key, value in shared.items()})
                portable[i] = entry
    return {
        "state": {i: portable[i] for i in sorted(portable)},
        "param_groups": [
            dict(_hyperparameters(group), params=indices)
            for group, indices in zip(state["param_groups"], layout.groups)
        ],
        "param_names": [p.name for p in layout.parameters],
    }


def _hyperparameters(group: Mapping[str, Any]) -> Dict[str, Any]:
    # torch's own ``param_names`` name the optimizer's parameters, the flat ones under FSDP: never carried across
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


def _in_optimizer_order(
    expected: Sequence[Sequence[_PlainParameter]], opt_state: Mapping[str, Any], optimizer: Optimizer
) -> Mapping[str, Any]:
    """``opt_state`` with its param groups, and the parameters in each, as in ``expected`` (the parameters of each
    of ``optimizer``'s groups) where its ``"param_names"`` name the same parameters in another order or grouping:
    each expected group taken from the one saved group that holds all its parameters, every saved group and
    parameter used; a saved group gives several only where ``optimizer`` configures those with equal
    hyperparameters (as they were, merged, in the file). Else ``opt_state`` itself, left to the check. A file
    converted from a torch DCP directory has no other order than its ``.metadata``'s, where the entries that several
    ranks hold come in the order of the rank that wrote them, and flattened groups with equal hyperparameters come
    back as one."""
    names, groups = opt_state.get("param_names"), opt_state.get("param_groups")
    if names is None or groups is None:
        return opt_state
    try:
        saved = [[names[i] for i in group["params"]] for group in groups]
    except (IndexError, TypeError):
        return opt_state
    wanted = [[param.name for param in params] for params in expected]
    if saved == wanted:
        return opt_state
    group_of = {name: g for g, members in enumerate(saved) for name in members}
    index_of = {name: i for i, name in enumerate(names)}
    if len(group_of) != sum(map(len, saved)) or len(index_of) != len(names):
        return opt_state  # a name twice: nothing to match by
    homes = []
    for params in wanted:
        home = {group_of.get(name) for name in params}
        if len(home) != 1 or None in home:
            return opt_state  # other parameters, or a group split across saved ones: the check names it
        homes.append(home.pop())
    every_name_once = sorted(name for params in wanted for name in params) == sorted(group_of)
    if not every_name_once or set(homes) != set(range(len(saved))) or len(wanted) != len(optimizer.param_groups):
        return opt_state
    for g in set(homes):
        configured = [_hyperparameters(group) for group, home in zip(optimizer.param_groups, homes) if home == g]
        if any(not _equal_hyperparameters(configured[0], other) for other in configured[1:]):
            return opt_state  # one saved group for groups configured apart: not a merge, the check refuses it
    ordered = [
        # a copy per group: a tensor hyperparameter of a saved group that gives two must not be shared by them
        dict(copy.deepcopy(_hyperparameters(groups[g])), params=[index_of[name] for name in params])
        for params, g in zip(wanted, homes)
    ]
    return dict(opt_state, param_groups=ordered)


def _equal_hyperparameters(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two param groups' hyperparameters are the same: the same keys, values of the same type, a tensor
    (``lr``) of the same dtype and values."""

    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            both = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
            return both and x.dtype == y.dtype and torch.equal(x, y)
        return type(x) is type(y) and bool(x == y)

    return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)


def _first_mismatch(expected: Sequence[Sequence[_PlainParameter]], opt_state: Mapping[str, Any]) -> Optional[str]:
    """What first keeps the saved optimizer state ``opt_state`` (``optimizer.state_dict()``-like, optionally with
    ``"param_names"``) from mapping onto the parameters ``expected`` in each param group, or ``None`` if it maps.
    Every state tensor but 0-d ones must have its parameter's shape, as FairScale (and so the FSDP re-shard) takes it.
    """
    saved_groups = opt_state["param_groups"]
    if len(saved_groups) != len(expected):
        return f"the checkpoint has {len(saved_groups)} param groups, the optimizer {len(expected)}"
    names = opt_state.get("param_names")
    for g, (saved_group, params) in enumerate(zip(saved_groups, expected)):
        saved = list(saved_group["params"])
        if len(saved) != len(params):
            return _group_size_mismatch(g, saved, params, names)
        for saved_index, param in zip(saved, params):
            if names is not None and names[saved_index] != param.name:
                return (
                    f"param group {g} holds {names[saved_index]!r} in the checkpoint where the optimizer holds"
                    f" {param.name!r}"
                )
            for key, value in opt_state["state"].get(saved_index, {}).items():
                if _is_param_shaped(value) and value.shape != param.shape:
                    return (
                        f"{param.name!r}: the checkpoint's `{key}` has shape {tuple(value.shape)}, the parameter"
                        f" {tuple(param.shape)}"
                    )
    return None


def _group_size_mismatch(
    g: int, saved: List[int], params: Sequence[_PlainParameter], names: Optional[List[str]]
) -> str:
    message = (
        f"param group {g} holds {len(saved)} parameters in the checkpoint but {len(params)} here (counting the"
        " parameters that each FSDP flat parameter holds)"
    )
    if names is not None:
        here = {p.name for p in params}
        extra = [names[i] for i in saved if names[i] not in here]
        if extra:
            return f"{message}; the first one only the checkpoint has there: {extra[0]!r}"
    if params:
        return f"{message}, whose first is {params[0].name!r}"
    return message


def _load_error(message: str) -> MisconfigurationException:
    # a failed load, so a ``CheckpointError`` as every one the fork raises, and still the user's error
    return _checkpoint_error_type(MisconfigurationException)(message)


def _mismatch_error(optimizer: Optimizer, mismatch: str, hint: str = "") -> MisconfigurationException:
    return _load_error(
        f"The checkpoint's state of the optimizer `{type(optimizer).__name__}` does not fit the LightningModule:"
        f" {mismatch}. Create the model and its optimizer as they were when the checkpoint was saved.{hint}"
    )


_FSDP_GROUPS_HINT = (
    " Under `DDPFullyShardedStrategy` a param group holds whole FSDP units (FairScale flattens each unit into one"
    " parameter with one `requires_grad`), so a group that splits a unit, such as no weight decay on the biases"
    " inside it, cannot be restored: align the groups with the units."
)


def _fitting_optimizer_state(
    module: Module, optimizer: Optimizer, opt_state: Mapping[str, Any]
) -> Mapping[str, Any]:
    """The state for ``optimizer.load_state_dict``, which loads by position, of the unsharded ``module`` (any
    strategy but the fork's FSDP): a portable optimizer state (with ``"param_names"``) in the optimizer's order of
    its groups and parameters (see :func:`_in_optimizer_order`), checked to map onto it. Other states (of a run
    without FSDP) are left to ``load_state_dict``, as in 1.6.5.

    Raises:
        MisconfigurationException: if it holds a layout only ``DDPFullyShardedStrategy`` reads, or does not map.
    """
    if "fsdp_per_rank" in opt_state:
        raise _load_error(
            "The checkpoint's optimizer state was saved by `DDPFullyShardedStrategy` with `flatten_parameters=False`:"
            " it holds each rank's own FSDP state, which only that strategy, with the same number of processes, loads."
        )
    if any(key in opt_state for key in _FSDP_ONLY_KEYS):
        raise _load_error(
            "The checkpoint's optimizer state was saved by `DDPFullyShardedStrategy` of a fork revision before 81,"
            " in a layout only that strategy reads. Resume it once with `strategy=\"fsdp\"` and save it again: the"
            " fork now saves an optimizer state that any strategy loads."
        )
    if "param_names" not in opt_state or "param_groups" not in opt_state:
        return opt_state
    names = {id(param): name for name, param in module.named_parameters()}
    expected = [
        [_PlainParameter(names.get(id(p), f"<not in the model: {tuple(p.shape)}>"), p.shape, ()) for p in g["params"]]
        for g in optimizer.param_groups
    ]
    opt_state = _in_optimizer_order(expected, opt_state, optimizer)
    mismatch = _first_mismatch(expected, opt_state)
    if mismatch is not None:
        raise _mismatch_error(optimizer, mismatch)
    return opt_state


def _load_portable_optimizer_state(module: Module, optimizer: Optimizer, opt_state: Mapping[str, Any]) -> None:
    """Load a portable (or a plain run's) optimizer state into ``optimizer`` over the FSDP flat parameters of
    ``module``: each rank takes its shard of each flat parameter, from the pieces of the original parameters it holds,
    copying only that shard's elements. A Lightning 1.6.5 FSDP file (rank 0's own shard, told apart by its counts
    and shapes) restores only the hyperparameters, with a warning."""
    layout = _portable_layout(module, optimizer)
    expected = [[layout.parameters[i] for i in indices] for indices in layout.groups]
    opt_state = _in_optimizer_order(expected, opt_state, optimizer)
    mismatch = _first_mismatch(expected, opt_state)
    if mismatch is not None:
        if _is_rank_zero_shard(module, optimizer, opt_state):
            _load_hyperparameters_of_rank_zero_shard(optimizer, opt_state)
            return
        raise _mismatch_error(optimizer, mismatch, _FSDP_GROUPS_HINT)
    if "param_names" not in opt_state:
        _check_same_weight_decay(optimizer, opt_state)
    saved_index = {
        i: saved
        for indices, group in zip(layout.groups, opt_state["param_groups"])
        for i, saved in zip(indices, group["params"])
    }
    instance_of = {id(flat): instance for instance in _fsdp_instances(module) for flat in instance.params}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: Dict[int, Dict[str, Any]] = {}
    for entries in layout.members:
        for j, indices in entries:
            saved = [opt_state["state"].get(saved_index[i]) for i in indices]
            if all(entry is None for entry in saved):
                continue  # no state (frozen or unused), as in the run that saved it
            instance = instance_of.get(id(params[j]))
            if instance is None:
                state[j] = saved[0]
            else:
                shapes = [layout.parameters[i].shape for i in indices]
                state[j] = _shard_of_pieces(instance, saved, shapes)
    optimizer.load_state_dict(
        {
            "state": state,
            "param_groups": [
                dict(_hyperparameters(saved_group), params=[j for j, _ in entries])
                for saved_group, entries in zip(opt_state["param_groups"], layout.members)
            ],
        }
    )


def _check_same_weight_decay(optimizer: Optimizer, opt_state: Mapping[str, Any]) -> None:
    """A state without ``param_names`` (a run without FSDP) maps by position: groups of the same sizes but other
    members would load into the wrong parameters. A different ``weight_decay`` per group, which no scheduler changes,
    is the sign of such groups (e.g. no decay on the biases of a plain run, which FSDP cannot split from their unit).
    """
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, opt_state["param_groups"])):
        if "weight_decay" in group and "weight_decay" in saved and group["weight_decay"] != saved["weight_decay"]:
            raise _mismatch_error(
                optimizer,
                f"param group {g} has weight_decay={saved['weight_decay']} in the checkpoint but"
                f" {group['weight_decay']} in the optimizer, so its groups hold other parameters than when it was"
                " saved",
                _FSDP_GROUPS_HINT,
            )


def _shard_of_pieces(
    instance: Any, pieces: List[Optional[Mapping[str, Any]]], shapes: List[torch.Size]
) -> Dict[str, Any]:
    """This rank's state of the flat parameter of the FSDP ``instance`` from the states of its ``pieces`` (of the
    given ``shapes``). A piece without state (a parameter that got no gradient in the run that saved it, e.g. an
    unused pooler) counts as zeros, which is what FSDP's own state holds for it."""
    elementwise = _elementwise_keys(pieces)
    present = [piece for piece in pieces if piece is not None]
    shard: Dict[str, Any] = {}
    for key, value in present[0].items():
        if key not in elementwise:
            shard[key] = _own_copy(value)
            continue
        like = next(piece[key] for piece in present if key in piece)
        flat = [
            piece[key] if piece is not None and key in piece else like.new_zeros(shape)
            for piece, shape in zip(pieces, shapes)
        ]
        shard[key] = _flat_slice(flat, instance.rank, instance.world_size)
    return shard


def _is_rank_zero_shard(module: Module, optimizer: Optimizer, opt_state: Mapping[str, Any]) -> bool:
    """Whether a plain ``optimizer.state_dict()`` is global rank 0's own shard over FSDP flat parameters, as
    Lightning <= 1.6.5 saved it: one entry per parameter of the FSDP optimizer in each group, and only flat (1-d)
    tensors for the flat parameters."""
    groups = opt_state["param_groups"]
    if len(groups) != len(optimizer.param_groups) or "param_names" in opt_state:
        return False
    if any(len(s["params"]) != len(g["params"]) for s, g in zip(groups, optimizer.param_groups)):
        return False
    flats = {id(flat) for instance in _fsdp_instances(module) for flat in instance.params}
    for saved, group in zip(groups, optimizer.param_groups):
        for index, param in zip(saved["params"], group["params"]):
            values = [v for v in opt_state["state"].get(index, {}).values() if _is_param_shaped(v)]
            if any(v.dim() != 1 if id(param) in flats else v.shape != param.shape for v in values):
                return False
    return True


def _load_hyperparameters_of_rank_zero_shard(optimizer: Optimizer, opt_state: Mapping[str, Any]) -> None:
    """Load the param groups' hyperparameters of an optimizer state saved by Lightning <= 1.6.5 (global rank 0's
    shard), and warn that its per-parameter state cannot be restored."""
    rank_zero_warn(
        "The checkpoint's optimizer state is global rank 0's own shard of the FSDP flat parameters, as Lightning"
        " <= 1.6.5 saved it, not the full state over the original parameters that `DDPFullyShardedStrategy` saves"
        " now, so loading it would give every rank rank 0's state. The per-parameter state of"
        f" `{type(optimizer).__name__}` (e.g. momentum or"
        " running averages) is therefore not restored and starts fresh; its hyperparameters (e.g. the"
        " learning rate) are restored, and the model weights are loaded as usual."
    )
    for group, saved_group in zip(optimizer.param_groups, opt_state["param_groups"]):
        group.update(_hyperparameters(saved_group))
