"""Single-process checks of CheckpointError (the fork/checkpoint-errors-on-every-rank patch); the 2-rank fault
scenarios are in tests/strategies/test_ddp_fully_sharded_faults.py."""
import builtins
import errno
import os
import pickle
import sys
from unittest import mock

import pytest
import torch

from fsdp_harness.corrupt_checkpoint import KINDS, make_bad_checkpoint
from fsdp_harness.scenario import quiet_trainer_kwargs
from pytorch_lightning import Trainer
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.trainer.connectors.checkpoint_connector import CheckpointConnector
from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_error_type, _checkpoint_error_type_named
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException
from tests.helpers.optimizer_models import SGDModel


class FullDiskIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _trainer(tmp_path, **kwargs):
    defaults = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=0)
    return Trainer(**quiet_trainer_kwargs(tmp_path, 1, **{**defaults, **kwargs}))


def test_failed_save_raises_checkpoint_error_naming_the_path(tmp_path):
    trainer = _trainer(tmp_path, plugins=[FullDiskIO()])
    trainer.fit(SGDModel())
    path = tmp_path / "model.ckpt"
    with pytest.raises(CheckpointError, match="Saving the checkpoint to .*model.ckpt.* failed: OSError") as info:
        trainer.save_checkpoint(path)
    assert isinstance(info.value.__cause__, OSError)
    # what Lightning 1.6.5 raised is still caught as such
    assert isinstance(info.value, OSError)
    assert not path.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_checkpoint_on_resume_raises_checkpoint_error_naming_the_path(tmp_path, kind):
    good = tmp_path / "good.ckpt"
    trainer = _trainer(tmp_path)
    trainer.fit(SGDModel())
    trainer.save_checkpoint(good)
    bad = tmp_path / f"{kind}.ckpt"
    make_bad_checkpoint(kind, good, bad)
    model = SGDModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_epochs=2)
    with pytest.raises(CheckpointError, match=f"Loading the .*{kind}.ckpt.* failed") as info:
        trainer.fit(model, ckpt_path=str(bad))
    # the error is also of the type that Lightning 1.6.5 raised, so ``except <that type>:`` still catches it
    cause = info.value.__cause__
    assert cause is not None and not isinstance(cause, CheckpointError)
    assert isinstance(info.value, type(cause))
    if not isinstance(CheckpointError(), type(cause)):  # a RuntimeError needs no subclass
        assert type(info.value).__name__ == f"CheckpointError[{type(cause).__name__}]"
    assert trainer.global_step == 0
    # no partial load either
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _connector(rank, failed_ranks, world_size=2, type_names=None):
    trainer = mock.Mock(world_size=world_size, global_rank=rank)
    trainer.strategy.root_device = torch.device("cpu")
    trainer.strategy.all_gather.side_effect = lambda t: torch.tensor([int(r in failed_ranks) for r in range(2)])
    messages = {0: "OSError: [Errno 28] No space left on device", 1: "ValueError: boom"}
    type_names = type_names or {0: ("builtins", "OSError"), 1: ("builtins", "ValueError")}
    trainer.strategy.broadcast.side_effect = lambda obj, src: (messages[src], *type_names[src])
    return CheckpointConnector(trainer)


@mock.patch("pytorch_lightning.trainer.connectors.checkpoint_failures.distributed_available", return_value=True)
def test_failure_on_one_rank_raises_on_every_rank(_):
    # rank 1 did not fail, rank 0 did: rank 1 raises with rank 0's message
    with pytest.raises(CheckpointError, match="'x.ckpt' failed on global rank 0: OSError.*No space left") as info:
        connector = _connector(rank=1, failed_ranks=[0])
        connector._failures.raise_on_every_rank_if_any_failed(None, "Saving the checkpoint to 'x.ckpt'")
    assert info.value.__cause__ is None
    # the failing rank chains its own error
    error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointError, match="failed on global rank 0") as info:
        _connector(rank=0, failed_ranks=[0, 1])._failures.raise_on_every_rank_if_any_failed(error, "Saving")
    assert info.value.__cause__ is error
    assert "also failed on global ranks [1]" in str(info.value)
    # nobody failed: no error, and no broadcast
    connector = _connector(rank=1, failed_ranks=[])
    connector._failures.raise_on_every_rank_if_any_failed(None, "Saving")
    connector.trainer.strategy.broadcast.assert_not_called()


@pytest.mark.parametrize("strategy_name, collective", [("ddp", False), ("fsdp", True)])
@mock.patch("pytorch_lightning.trainer.connectors.checkpoint_failures.distributed_available", return_value=True)
def test_save_is_collective_only_where_saving_already_is(_, strategy_name, collective):
    """FSDP gathers the state on every rank, so the save ends with the failure-flag collective; plain DDP allows
    ``trainer.save_checkpoint`` on rank 0 alone, where that collective would hang."""
    from pytorch_lightning.strategies import DDPFullyShardedStrategy, DDPStrategy
    from pytorch_lightning.strategies.fsdp_checkpoint_state import _FSDPCheckpointState, _SaveSession

    connector = _connector(rank=0, failed_ranks=[])
    strategy_cls = DDPFullyShardedStrategy if strategy_name == "fsdp" else DDPStrategy
    connector.trainer.strategy.__class__ = type("Spec", (strategy_cls,), {})
    connector.trainer.strategy.save_checkpoint = mock.Mock()
    # the FSDP strategy's checkpoint state and the session of this save, as the strategy makes them
    connector.trainer.strategy._checkpointer.state = _FSDPCheckpointState()
    connector.trainer.strategy._checkpointer.begin_save.return_value = _SaveSession()
    with mock.patch.object(connector, "dump_checkpoint", return_value={}):
        connector.save_checkpoint("x.ckpt")
    assert connector.trainer.strategy.all_gather.called is collective
    # a failing write raises the CheckpointError either way
    connector.trainer.strategy.save_checkpoint.side_effect = OSError(errno.ENOSPC, "No space left on device")
    connector.trainer.strategy.all_gather.side_effect = lambda t: torch.tensor([1, 0])
    with mock.patch.object(connector, "dump_checkpoint", return_value={}), pytest.raises(
        CheckpointError, match="x.ckpt"
    ):
        connector.save_checkpoint("x.ckpt")


def test_missing_checkpoint_is_still_a_file_not_found_error(tmp_path):
    """Lightning 1.6.5 raised ``FileNotFoundError`` for a missing ``ckpt_path``; user code that catches it must still
    catch it."""
    trainer = _trainer(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.ckpt.* not found. Aborting training") as info:
        trainer.fit(SGDModel(), ckpt_path=str(tmp_path / "missing.ckpt"))
    assert isinstance(info.value, CheckpointError)
    assert isinstance(info.value.__cause__, FileNotFoundError)


class EmptyIteratorIO(TorchCheckpointIO):
    def load_checkpoint(self, path, map_location=None):
        return next(iter(()))  # e.g. a custom loader that finds no shard


def test_stop_iteration_while_loading_is_a_checkpoint_error(tmp_path):
    """A ``StopIteration`` raised while loading stays a ``CheckpointError[StopIteration]`` naming the path (raised
    from a generator, Python would turn it into a ``RuntimeError``)."""
    path = tmp_path / "model.ckpt"
    trainer = _trainer(tmp_path)
    trainer.fit(SGDModel())
    trainer.save_checkpoint(path)
    trainer = _trainer(tmp_path, max_epochs=2, plugins=[EmptyIteratorIO()])
    match = "Loading the checkpoint from .*model.ckpt.* failed: StopIteration"
    with pytest.raises(CheckpointError, match=match) as info:
        trainer.fit(SGDModel(), ckpt_path=str(path))
    assert isinstance(info.value, StopIteration)


@pytest.mark.parametrize(
    "original, args",
    [
        (FileNotFoundError, (errno.ENOENT, "No such file or directory", "x.ckpt")),
        (OSError, (errno.ENOSPC, "No space left on device")),
        (KeyError, ("state_dict",)),
        (UnicodeDecodeError, ("utf-8", b"\xff", 0, 1, "invalid start byte")),
        (pickle.UnpicklingError, ("invalid load key, '\\x9c'.",)),
        (EOFError, ("Ran out of input",)),
        (TypeError, ("not a dict",)),
    ],
)
def test_checkpoint_error_type_keeps_the_original_type(original, args):
    """Types whose ``__init__`` takes special arguments or whose ``__str__`` differs still give a ``CheckpointError``
    that is an instance of them, carries the message as is, pickles, and is created once per type."""
    error_type = _checkpoint_error_type(original)
    assert error_type is _checkpoint_error_type(original)
    assert error_type is _checkpoint_error_type(error_type)  # not wrapped twice
    assert issubclass(error_type, CheckpointError) and issubclass(error_type, original)
    error = error_type("Loading the checkpoint from 'x.ckpt' failed: boom.")
    assert str(error) == "Loading the checkpoint from 'x.ckpt' failed: boom."  # e.g. not quoted like a KeyError
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is error_type and str(copy) == str(error)
    # what the other ranks rebuild from the name of the type
    assert _checkpoint_error_type_named(original.__module__, original.__qualname__) is error_type
    with pytest.raises(original):
        raise error


class _FinalError(Exception):
    def __init_subclass__(cls, **kwargs):
        raise TypeError("cannot be subclassed")


# ``ExceptionGroup`` is a builtin from Python 3.11; the fork supports 3.10 too.
@pytest.mark.parametrize(
    "original",
    [RuntimeError, Exception, CheckpointError, _FinalError]
    + ([builtins.ExceptionGroup] if sys.version_info >= (3, 11) else [])
    + [KeyboardInterrupt],
)
def test_checkpoint_error_type_falls_back_to_checkpoint_error(original):
    """Types that ``CheckpointError`` already is, that cannot be subclassed, that cannot be built from a message, or
    that are not an ``Exception`` give plain ``CheckpointError``."""
    assert _checkpoint_error_type(original) is CheckpointError


@pytest.mark.parametrize(
    "module, qualname",
    [
        ("no_such_module", "Error"),
        ("builtins", "NoSuchError"),
        ("builtins", "len"),
        ("os", "path"),
        ("a", "<locals>.E"),
    ],
)
def test_checkpoint_error_type_named_falls_back_to_checkpoint_error(module, qualname):
    assert _checkpoint_error_type_named(module, qualname) is CheckpointError


@mock.patch("pytorch_lightning.trainer.connectors.checkpoint_failures.distributed_available", return_value=True)
def test_every_rank_raises_the_original_type(_):
    """The rank that did not fail raises the type of the failing rank's error, which it only knows by name."""
    names = {0: ("builtins", "FileNotFoundError"), 1: ("builtins", "ValueError")}
    connector = _connector(rank=1, failed_ranks=[0], type_names=names)
    with pytest.raises(FileNotFoundError, match="failed on global rank 0") as info:
        connector._failures.raise_on_every_rank_if_any_failed(None, "Loading the checkpoint from 'x.ckpt'")
    assert isinstance(info.value, CheckpointError)
    # the failing rank sends the name of its error's type, and raises that type itself
    error = FileNotFoundError(errno.ENOENT, "No such file or directory")
    connector = _connector(rank=0, failed_ranks=[0], type_names=names)
    with pytest.raises(FileNotFoundError) as info:
        connector._failures.raise_on_every_rank_if_any_failed(error, "Loading the checkpoint from 'x.ckpt'")
    assert isinstance(info.value, CheckpointError) and info.value.__cause__ is error
    # a rank that failed too raises its own type
    connector = _connector(rank=1, failed_ranks=[0, 1], type_names=names)
    with pytest.raises(KeyError) as info:
        connector._failures.raise_on_every_rank_if_any_failed(KeyError("state_dict"), "Loading")
    assert isinstance(info.value, CheckpointError) and "failed on global rank 0" in str(info.value)
    # a type that the other rank cannot import: plain CheckpointError
    connector = _connector(rank=1, failed_ranks=[0], type_names={0: ("not_here", "Error")})
    with pytest.raises(CheckpointError) as info:
        connector._failures.raise_on_every_rank_if_any_failed(None, "Loading")
    assert type(info.value) is CheckpointError


@mock.patch("pytorch_lightning.trainer.connectors.checkpoint_failures.distributed_available", return_value=True)
def test_misconfiguration_keeps_its_type(_):
    """The rank with a ``MisconfigurationException`` re-raises it unchanged; the others raise one too."""
    error = MisconfigurationException("unsupported")
    names = {0: ("pytorch_lightning.utilities.exceptions", "MisconfigurationException")}
    with pytest.raises(MisconfigurationException) as info:
        failures = _connector(rank=0, failed_ranks=[0], type_names=names)._failures
        failures.raise_on_every_rank_if_any_failed(error, "Loading")
    assert info.value is error
    with pytest.raises(MisconfigurationException, match="failed on global rank 0") as info:
        failures = _connector(rank=1, failed_ranks=[0], type_names=names)._failures
        failures.raise_on_every_rank_if_any_failed(None, "Loading")
    assert isinstance(info.value, CheckpointError)
    with pytest.raises(MisconfigurationException) as info:
        _connector(rank=0, failed_ranks=[], world_size=1)._failures.raise_on_every_rank_if_any_failed(error, "Loading")
    assert info.value is error
