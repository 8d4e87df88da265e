"""``PL_CHECKPOINT_TIMEOUT``: how long the ranks wait for each other in the checkpoint failure-flag exchange,
``PL_CHECKPOINT_ARRIVAL_TIMEOUT``: how long they wait for each other to begin a save, and
``PL_CHECKPOINT_GLOO_GROUP``: whether that exchange gets a gloo group of its own."""
from datetime import timedelta

import pytest

from pytorch_lightning.utilities.checkpoint_errors import (
    _checkpoint_arrival_timeout,
    _checkpoint_gloo_group_wanted,
    _checkpoint_timeout,
    DEFAULT_CHECKPOINT_ARRIVAL_TIMEOUT,
    DEFAULT_CHECKPOINT_TIMEOUT,
)
from pytorch_lightning.utilities.exceptions import MisconfigurationException


def test_checkpoint_timeout(monkeypatch):
    monkeypatch.delenv("PL_CHECKPOINT_TIMEOUT", raising=False)
    assert _checkpoint_timeout() == DEFAULT_CHECKPOINT_TIMEOUT == timedelta(hours=2)
    monkeypatch.setenv("PL_CHECKPOINT_TIMEOUT", "7200.5")
    assert _checkpoint_timeout() == timedelta(seconds=7200.5)
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("PL_CHECKPOINT_TIMEOUT", bad)
        with pytest.raises(MisconfigurationException, match="PL_CHECKPOINT_TIMEOUT"):
            _checkpoint_timeout()


def test_checkpoint_arrival_timeout(monkeypatch):
    monkeypatch.delenv("PL_CHECKPOINT_TIMEOUT", raising=False)
    monkeypatch.delenv("PL_CHECKPOINT_ARRIVAL_TIMEOUT", raising=False)
    assert _checkpoint_arrival_timeout() == DEFAULT_CHECKPOINT_ARRIVAL_TIMEOUT == timedelta(minutes=10)
    monkeypatch.setenv("PL_CHECKPOINT_ARRIVAL_TIMEOUT", "90")
    assert _checkpoint_arrival_timeout() == timedelta(seconds=90)
    # never longer than the timeout of the exchanges that follow
    monkeypatch.setenv("PL_CHECKPOINT_TIMEOUT", "60")
    assert _checkpoint_arrival_timeout() == timedelta(seconds=60)
    monkeypatch.delenv("PL_CHECKPOINT_ARRIVAL_TIMEOUT")
    assert _checkpoint_arrival_timeout() == timedelta(seconds=60)
    for bad in ("0", "-5", "inf", "later"):
        monkeypatch.setenv("PL_CHECKPOINT_ARRIVAL_TIMEOUT", bad)
        with pytest.raises(MisconfigurationException, match="PL_CHECKPOINT_ARRIVAL_TIMEOUT"):
            _checkpoint_arrival_timeout()


def test_checkpoint_gloo_group_opt_out(monkeypatch):
    monkeypatch.delenv("PL_CHECKPOINT_GLOO_GROUP", raising=False)
    assert _checkpoint_gloo_group_wanted()
    for value, wanted in (("1", True), (" 0 ", False), ("", True)):
        monkeypatch.setenv("PL_CHECKPOINT_GLOO_GROUP", value)
        assert _checkpoint_gloo_group_wanted() is wanted
    for bad in ("no", "false", "2"):
        monkeypatch.setenv("PL_CHECKPOINT_GLOO_GROUP", bad)
        with pytest.raises(MisconfigurationException, match="PL_CHECKPOINT_GLOO_GROUP"):
            _checkpoint_gloo_group_wanted()
