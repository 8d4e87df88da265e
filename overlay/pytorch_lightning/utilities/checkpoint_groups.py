"""The lifetime of the fork's own gloo process groups (the checkpoint group made in ``setup``, the background-save
group): each is destroyed when it is dropped, and at the latest at interpreter exit, while the interpreter is still
whole.

Why: a gloo worker thread frees a finished collective, and the tensors in it, after the caller has returned from the
collective. When Python no longer holds those tensors, freeing them needs the GIL. If the script ends right after the
collective (the last failure-flag exchange of ``Trainer.save_checkpoint``), the worker may still be waiting for the
GIL when the interpreter starts finalizing; Python then ends the thread from inside that C++ destructor, and the
process aborts (``terminate called without an active exception``, SIGABRT). Destroying the group and dropping the
last reference to it joins its threads with the GIL released (torch's ``ProcessGroup`` destructor), so they finish
that work first. ``torch.distributed.destroy_process_group(group)`` alone only unregisters the group: its threads stay
until the last reference goes.

The hooks are the attributes of ``DDPFullyShardedStrategy._checkpoint_state`` that hold the groups:
``checkpoint_group`` (set in ``setup``) and ``background_group`` (set at the first save in the background).
"""
# fork-feature: fork/checkpoint-errors-on-every-rank.patch
import atexit
import gc
import weakref
from typing import Any, List, Optional, Tuple

import torch

#: The groups held through :func:`_hold_process_group` and not released yet: the holder (weakly), the attribute that
#: holds the group, and the group, in the order they were made.
_HELD: List[Tuple["weakref.ReferenceType[Any]", str, Any]] = []
_EXIT_HOOK_REGISTERED = False


def _hold_process_group(owner: Any, attribute: str, group: Optional[Any]) -> None:
    """``setattr(owner, attribute, group)`` for a process group the fork made, which :func:`_release_process_group`
    destroys, or interpreter exit where it was not released before.

    Args:
        owner: the object that holds the group (a strategy).
        attribute: the name of the attribute of ``owner`` that holds it.
        group: the group, or ``None`` (nothing to hold).
    """
    global _EXIT_HOOK_REGISTERED
    setattr(owner, attribute, group)
    if group is None:
        return
    if not _EXIT_HOOK_REGISTERED:
        # atexit runs after the program's non-daemon threads (a save in the background) have ended, and before the
        # interpreter starts finalizing
        atexit.register(_release_held_process_groups)
        _EXIT_HOOK_REGISTERED = True
    _HELD.append((weakref.ref(owner), attribute, group))


def _release_process_group(owner: Any, attribute: str) -> None:
    """Destroy the group that ``owner.<attribute>`` holds, if any, and set the attribute to ``None``. Local: no
    collective. The group's threads are joined here, unless something else still references the group.

    Args:
        owner: the object that holds the group.
        attribute: the name of the attribute of ``owner`` that holds it.
    """
    group = getattr(owner, attribute, None)
    setattr(owner, attribute, None)
    if group is None:
        return
    _HELD[:] = [held for held in _HELD if held[2] is not group]
    _destroy_group(group)
    released = weakref.ref(group)
    del group
    if released() is not None:
        # a reference cycle still holds it (a save in the background that failed, through its traceback): collected
        # now, while the interpreter is whole, rather than by the collection of the finalizing interpreter
        gc.collect()


def _release_held_process_groups() -> None:
    """At exit: release every group still held, the newest first."""
    released = []
    while _HELD:
        holder, attribute, group = _HELD.pop()
        owner = holder()
        if owner is not None and getattr(owner, attribute, None) is group:
            setattr(owner, attribute, None)
        _destroy_group(group)
        released.append(weakref.ref(group))
        del owner, group
    if any(ref() is not None for ref in released):
        # a reference cycle still holds one (a finished save in the background, through its closures): collected
        # now, while the interpreter is whole, instead of by the collection of the finalizing interpreter
        gc.collect()


def _destroy_group(group: Any) -> None:
    """Unregister ``group`` from ``torch.distributed``. Its threads are joined once the caller drops its reference,
    the last one."""
    if not torch.distributed.is_initialized():
        # ``destroy_process_group()`` of the default group has destroyed every group, this one too
        return
    try:
        torch.distributed.destroy_process_group(group)
    except ValueError:
        # the program destroyed it already
        pass
