"""``PL_CHECKPOINT_TIMEOUT``: how long the ranks wait for each other in the checkpoint failure-flag exchange."""
from datetime import timedelta

import pytest

from pytorch_lightning.utilities.checkpoint_errors import _checkpoint_timeout, DEFAULT_CHECKPOINT_TIMEOUT
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
