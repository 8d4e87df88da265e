"""A rank lost while the ranks write their own shards of a parallel save (``checkpoint_writers="all"``, see
:mod:`.fsdp_parallel_save`): killed in the middle of its writes, or slower than ``PL_CHECKPOINT_TIMEOUT``.

The other ranks' next exchange over the gloo checkpoint group then fails (gloo sees the closed connection, or times
out after ``PL_CHECKPOINT_TIMEOUT``) with an error that names no rank. So before each exchange of the writing steps
every rank marks its arrival in the default process group's store (c10d's key-value store, which outlives the
checkpoint group). A rank whose exchange failed names the ranks that did not arrive, publishes their names there and
closes its checkpoint group, so that a rank that arrives later fails at once and finds its own name there. Every rank
then raises a ``CheckpointError`` naming the lost ranks (see
:class:`~pytorch_lightning.utilities.collective_guard._PeerLost`); global rank 0, if it survives, removes the
temporary file, and the next ``Trainer`` stage replaces the closed group.
"""
# fork-feature: fork/fsdp-parallel-save.patch
import json
from contextlib import contextmanager
from typing import Generator, Optional, TYPE_CHECKING

import torch

from pytorch_lightning.utilities.checkpoint_errors import (
    _checkpoint_timeout,
    _close_checkpoint_process_group,
    _describe_error,
    CHECKPOINT_TIMEOUT_ENV,
)
from pytorch_lightning.utilities.collective_guard import _CollectiveGuard, _PeerFailed, _PeerLost

if TYPE_CHECKING:
    from pytorch_lightning.strategies.fully_sharded import DDPFullyShardedStrategy


class _Arrivals:
    """The marks of the ranks' arrivals at the exchanges of one save, in the default process group's store: one key
    per rank, overwritten by each save (a job's store does not grow with its saves).

    Args:
        strategy: the strategy whose ranks save.
        save: names the save on every rank (its temporary file), so that the marks of earlier saves do not count.
    """

    def __init__(self, strategy: "DDPFullyShardedStrategy", save: str) -> None:
        # c10d's store of the default group (rank 0's ``TCPStore``, or the launcher's): no public accessor in torch
        get_default_store = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
        self._store = get_default_store() if get_default_store is not None else None
        self._save, self._rank, self._world_size = save, strategy.global_rank, strategy.world_size
        self._steps = 0

    def arrive(self) -> None:
        """Mark that this rank reached its next exchange of the save."""
        self._steps += 1
        if self._store is not None:
            self._store.set(self._key(self._rank), f"{self._steps} {self._save}")

    def lost(self, error: BaseException) -> _PeerLost:
        """After this rank's exchange failed with ``error``: the ranks that did not reach it, published for the
        others; or, where every rank reached it, those another rank published (this rank arrived late)."""
        failed = f"the ranks' exchange while they wrote their shards failed with {_describe_error(error)}"
        if self._store is None:
            return _PeerLost([], failed)
        lost_key = f"{_STORE_PREFIX}/lost/{self._save}"
        try:
            missing = [rank for rank in range(self._world_size) if self._steps_of(rank) < self._steps]
            if missing:
                cause = (
                    f"{'it' if len(missing) == 1 else 'they'} did not reach the ranks' next exchange while they"
                    f" wrote their shards: lost (the process died) or slower than `{CHECKPOINT_TIMEOUT_ENV}`"
                    f" ({_checkpoint_timeout().total_seconds():g} s); the exchange failed with {_describe_error(error)}"
                )
                self._store.set(lost_key, json.dumps([missing, cause]))
                return _PeerLost(missing, cause)
            if self._store.check([lost_key]):
                return _PeerLost(*json.loads(self._store.get(lost_key)))
        except Exception as store_error:  # the store's host (global rank 0's process, in most launchers) is gone
            failed += f", and the ranks' store could not say which rank was lost ({_describe_error(store_error)})"
        return _PeerLost([], failed)

    def _steps_of(self, rank: int) -> int:
        """How many exchanges of this save ``rank`` reached."""
        if rank == self._rank:
            return self._steps
        key = self._key(rank)
        if not self._store.check([key]):
            return 0
        steps, save = self._store.get(key).decode().split(" ", 1)
        return int(steps) if save == self._save else 0

    @staticmethod
    def _key(rank: int) -> str:
        return f"{_STORE_PREFIX}/arrived/{rank}"


#: The prefix of this module's keys in the store.
_STORE_PREFIX = "pl_checkpoint_writers"


@contextmanager
def _naming_lost_ranks(
    strategy: "DDPFullyShardedStrategy", guard: _CollectiveGuard, save: Optional[str], close_group: bool = True
) -> Generator[None, None, None]:
    """Within the block, each exchange of ``guard`` marks this rank's arrival first; an exchange (or another
    collective) that fails raises :class:`_PeerLost` naming the ranks that did not arrive, once the checkpoint group
    is closed (``close_group``; a save in the background leaves it open: its writer thread uses a group of its own,
    which every rank drops when it waits for the save). The block's own failures are recorded in ``guard``
    (``guard.catch()``), so what escapes it is a failed collective. ``save`` names the save on every rank (its
    temporary file); ``None``: nothing to name."""
    if save is None or not torch.distributed.is_initialized() or strategy.world_size < 2:
        yield
        return
    arrivals = _Arrivals(strategy, save)
    guard.before_exchange = arrivals.arrive
    try:
        yield
    except _PeerFailed:
        raise
    except Exception as ex:
        lost = arrivals.lost(ex)
        if close_group:
            # the ranks still waiting in the group, or arriving later, fail at once instead of after its timeout
            _close_checkpoint_process_group(strategy, f"a rank was lost while the ranks wrote a checkpoint ({lost})")
        raise lost from ex
    finally:
        guard.before_exchange = None

