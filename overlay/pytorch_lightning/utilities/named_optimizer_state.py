"""The optimizer state of a Lightning checkpoint keyed by parameter name, the layout torch's distributed state-dict
API (``torch.distributed.checkpoint.state_dict``) loads into any model, plain, FSDP or FSDP2 (``fully_shard``)::

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    checkpoint = torch.load("last.ckpt", mmap=True, weights_only=True)
    named = named_optimizer_state(checkpoint["optimizer_states"][0])
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))

The view shares the checkpoint's tensors; it copies none (only the small dicts around them).
"""
# fork-feature: fork/checkpoint-converter.patch
from typing import Any, Dict, List, Mapping, Optional, Sequence

from pytorch_lightning.utilities.exceptions import MisconfigurationException

#: what checkpoints of earlier fork revisions hold instead of per-parameter state, and why it cannot be named
_UNNAMEABLE_LAYOUTS = {
    "fsdp_per_rank": "each FSDP process's own optimizer state (saved with `flatten_parameters=False`), over"
    " FairScale's per-rank parameters",
    "fsdp_roots": "FairScale's consolidated state per FSDP root, as earlier revisions of this fork wrote it",
    "param_id_map": "FairScale's consolidated state, as early revisions of this fork wrote it",
}


def named_optimizer_state(
    optimizer_state: Mapping[str, Any], param_names: Optional[Sequence[str]] = None
) -> Dict[str, Any]:
    """``{"state": {name: state}, "param_groups": [dict(group, params=[names])]}`` for an optimizer state that
    indexes its parameters ``0..n-1`` over its groups in order (``optimizer.state_dict()``, and what the fork's
    FSDP strategy writes); the input to ``set_optimizer_state_dict(..., StateDictOptions(full_state_dict=True))``.

    Args:
        optimizer_state: one entry of a checkpoint's ``"optimizer_states"``.
        param_names: the name (``state_dict`` key) of each parameter, by index. ``None``: the state's own
            ``"param_names"``, which the fork's FSDP checkpoints hold. A file from a DDP or single-device run has
            none: pass the names of the parameters the optimizer was given, in that order, for example
            ``[n for n, p in model.named_parameters() if p.requires_grad]`` for a ``configure_optimizers`` that
            passes the trainable parameters.

    Raises:
        MisconfigurationException: the state holds no per-parameter layout (a file of an earlier fork revision or
            one saved with ``flatten_parameters=False``), no names are known, or the names do not fit the groups.
    """
    for key, what in _UNNAMEABLE_LAYOUTS.items():
        if key in optimizer_state:
            raise MisconfigurationException(
                f"The optimizer state holds {what} (`{key}`), which cannot be keyed by parameter name: resume the"
                " checkpoint with this fork (`trainer.fit(model, ckpt_path=...)`) and save it again."
            )
    if "param_groups" not in optimizer_state or "state" not in optimizer_state:
        raise MisconfigurationException(
            f"The optimizer state holds {sorted(map(str, optimizer_state))}, not an optimizer's `state` and"
            " `param_groups`."
        )
    names = list(param_names if param_names is not None else optimizer_state.get("param_names") or [])
    if param_names is None and not names:
        raise MisconfigurationException(
            "The optimizer state holds no parameter names (`param_names`): it comes from a DDP or single-device run,"
            " or from Lightning 1.6.5's FSDP (rank 0's shard only). Pass `param_names`, the names of the optimizer's"
            " parameters in the order it was given them."
        )
    groups = optimizer_state["param_groups"]
    indices = [index for group in groups for index in group["params"]]
    _check_indices(indices, names, optimizer_state["state"])
    return {
        # new dicts around the same tensors: torch's ``set_optimizer_state_dict`` replaces values in the dicts it is
        # given (with sharded tensors), which must not change the checkpoint's own state
        "state": {names[index]: dict(state) for index, state in optimizer_state["state"].items()},
        "param_groups": [dict(group, params=[names[index] for index in group["params"]]) for group in groups],
    }


def _check_indices(indices: List[Any], names: List[str], state: Mapping[Any, Any]) -> None:
    """The groups index each of the ``len(names)`` parameters once, and the state only those."""
    if len(indices) != len(names):
        raise MisconfigurationException(
            f"The optimizer state's parameter groups hold {len(indices)} parameters, but {len(names)} parameter names"
            f" were given (first: {names[:1]}): the names must be those of the optimizer's parameters, in its order."
        )
    if sorted(indices) != list(range(len(names))):
        raise MisconfigurationException(
            f"The optimizer state's parameter groups index their parameters as {indices[:8]}...,"
            f" not 0..{len(names) - 1} once each, as `optimizer.state_dict()` does."
        )
    unknown = [index for index in state if not isinstance(index, int) or not 0 <= index < len(names)]
    if unknown:
        raise MisconfigurationException(
            f"The optimizer state holds state for parameter {unknown[0]!r}, which no parameter group holds."
        )
