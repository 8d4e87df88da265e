"""What a resumed run restored: the state at ``on_train_start``, compared entry by entry with a checkpoint's."""
import copy
from typing import Any, List

import torch

from pytorch_lightning import Callback


class RecordOnTrainStart(Callback):
    """Copies the model's and the first optimizer's state when training starts, i.e. after every restore."""

    def on_train_start(self, trainer, pl_module):
        self.state_dict = copy.deepcopy(pl_module.state_dict())
        self.optimizer_state = copy.deepcopy(trainer.optimizers[0].state_dict())


def state_mismatches(actual: Any, expected: Any, prefix: str = "") -> List[str]:
    """The paths (``/key/0/...``) where nested dicts, lists and tensors differ; tensors must match in dtype and
    value."""
    if isinstance(expected, torch.Tensor):
        ok = isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype and torch.equal(actual, expected)
        return [] if ok else [prefix]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            return [prefix + "/<keys>"]
        return [m for k in expected for m in state_mismatches(actual[k], expected[k], f"{prefix}/{k}")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [prefix + "/<len>"]
        return [m for i, (a, e) in enumerate(zip(actual, expected)) for m in state_mismatches(a, e, f"{prefix}/{i}")]
    return [] if actual == expected else [prefix]
