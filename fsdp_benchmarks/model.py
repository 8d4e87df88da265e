"""The benchmark's model: K FSDP-wrapped blocks whose fp32 state dict is S MiB, built from N, S and K only.

It is :class:`fsdp_harness.models.FSDPModel` (same keys, ``layer.<i>.0.weight``/``bias``, same data and
optimizers), except that the blocks are *created* in ``__init__`` and only *wrapped* in ``configure_sharded_model``.
Lightning 1.6.5 restores a ``ckpt_path`` before ``configure_sharded_model`` for this strategy, so a model whose layers
first appear there cannot resume (``Unexpected key(s) in state_dict``); creating them up front lets the benchmark
measure a real ``Trainer.fit(ckpt_path=...)`` resume both with upstream's restore order and with a fork that restores
after sharding.
"""
import math

import torch
from torch import nn

from fsdp_harness.models import FSDPModel

MIB = 1024 * 1024
#: optimizer-state values per model parameter in a complete checkpoint
STATE_SLOTS = {"sgd": 1, "sgd-plain": 0, "adam": 2}


def width_for(size_mb: float, units: int) -> int:
    """Largest width whose ``units`` blocks (``w*w + w`` fp32 values each) fit in ``size_mb`` MiB."""
    per_unit = size_mb * MIB / 4 / units
    width = int(math.isqrt(int(per_unit)))
    while width * width + width > per_unit:
        width -= 1
    return max(width, 1)


def state_dict_mb(width: int, units: int) -> float:
    return units * (width * width + width) * 4 / MIB


def model_seed(size_mb: float, units: int, world_size: int) -> int:
    return (world_size * 1_000_003 + int(size_mb * 1000) * 31 + units) % (2**31)


def shape_mb(units: int, width: int, heads: int = 0) -> float:
    """The fp32 state dict's MiB of ``units`` blocks of ``width`` and, with ``heads``, the two heads."""
    return state_dict_mb(width, units) + (2 * heads * width + width + heads) * 4 / MIB if heads else state_dict_mb(
        width, units
    )


class CheckpointModel(FSDPModel):
    """K blocks of ``Linear(w, w)`` and ``Tanh``, each its own FSDP unit, w from S and K (:func:`width_for`) or given
    as ``width``. With ``heads`` H, an input head ``Linear(H, w)`` and an output head ``Linear(w, H)`` come before and
    after the blocks, each its own FSDP unit too, as a transformer's embedding and output projection are: the model
    then takes and gives vectors of H."""

    def __init__(
        self, size_mb: float, units: int, world_size: int, optimizer: str = "sgd", batches: int = 2,
        width: int = 0, heads: int = 0,
    ) -> None:
        block = width or width_for(size_mb, units)
        super().__init__(width=heads or block, units=units, wrapping="wrap", optimizer=optimizer, batches=batches)
        # Seeded from N, S and K only, so every rank and every configuration builds the same model.
        torch.manual_seed(model_seed(size_mb, units, world_size))
        layers = [nn.Sequential(nn.Linear(block, block), nn.Tanh()) for _ in range(units)]
        if heads:
            layers = [nn.Linear(heads, block), *layers, nn.Linear(block, heads)]
        self.layer = nn.Sequential(*layers)
        self.block_width = block
        #: the fp32 state dict's MiB, S
        self.state_dict_mb = shape_mb(units, block, heads)
        self._wrapped = False

    def configure_sharded_model(self) -> None:
        from fairscale.nn import wrap

        if self._wrapped:
            return
        self.layer = wrap(nn.Sequential(*[wrap(block) for block in self.layer]))
        self._wrapped = True
