"""LightningModules whose layers are created and wrapped in ``configure_sharded_model``, as Lightning's FSDP docs
recommend for large models. Used by the CPU FSDP scenarios and the checkpoint-memory benchmark."""
import contextlib
import itertools
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from pytorch_lightning import LightningModule


class FSDPModel(LightningModule):
    """``units`` FSDP-wrapped blocks of ``width x width`` linear layers inside one outer FSDP wrapper.

    Args:
        width: feature width; one block holds ``width * width + width`` parameters.
        units: number of blocks, each its own FSDP instance (the unit that is gathered at a time).
        wrapping: ``"wrap"`` wraps each block and the stack explicitly (nested ``wrap``); ``"auto_wrap"`` lets
            FairScale's policy decide (with the strategy's ``min_num_params``).
        extra_before / extra_after: add a plain (non-FSDP) parameter registered before / after the FSDP stack, so
            the state dict has entries outside any FSDP instance on both sides.
        optimizer: ``"sgd"`` (momentum), ``"sgd-plain"`` (no state) or ``"adam"``.
        scheduler: add a StepLR scheduler.
        batches: training batches per epoch.
        train_extras: whether the non-FSDP parameters are trained. Frozen, they stay out of the optimizer, whose
            state the strategy can then consolidate through the single outer FSDP instance.
    """

    def __init__(
        self,
        width: int = 32,
        units: int = 2,
        wrapping: str = "wrap",
        extra_before: bool = False,
        extra_after: bool = False,
        optimizer: str = "sgd",
        scheduler: bool = False,
        batches: int = 4,
        lr: float = 0.01,
        train_extras: bool = True,
    ) -> None:
        super().__init__()
        self.width, self.units, self.wrapping = width, units, wrapping
        self.optimizer_name, self.use_scheduler, self.batches, self.lr = optimizer, scheduler, batches, lr
        self.layer: Optional[nn.Module] = None
        self.train_extras = train_extras
        if extra_before:
            self.before = nn.Parameter(torch.linspace(-1, 1, width), requires_grad=train_extras)
        self.extra_after = extra_after

    def configure_sharded_model(self) -> None:
        from fairscale.nn import auto_wrap, wrap

        if self.layer is not None:
            return
        blocks = [nn.Sequential(nn.Linear(self.width, self.width), nn.Tanh()) for _ in range(self.units)]
        if self.wrapping == "wrap":
            self.layer = wrap(nn.Sequential(*[wrap(block) for block in blocks]))
        elif self.wrapping == "auto_wrap":
            self.layer = auto_wrap(nn.Sequential(*blocks))
        else:
            raise ValueError(f"unknown wrapping {self.wrapping!r}")
        if self.extra_after:
            self.after = nn.Parameter(torch.linspace(1, 2, self.width), requires_grad=self.train_extras)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "before"):
            x = x + self.before
        x = self.layer(x)
        if hasattr(self, "after"):
            x = x * self.after
        return x

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        # Towards an all-ones output: any differentiable scalar would do.
        prediction = self(batch)
        return nn.functional.mse_loss(prediction, torch.ones_like(prediction))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        # ``val_loss`` is what the scenarios' ModelCheckpoint monitors.
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(params, lr=self.lr)
        elif self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "sgd-plain":
            # no momentum: a stateless optimizer, so a checkpoint holds the model alone
            optimizer = torch.optim.SGD(params, lr=self.lr)
        else:
            raise ValueError(f"unknown optimizer {self.optimizer_name!r}")
        if not self.use_scheduler:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def _loader(self) -> DataLoader:
        # Random vectors from the global seed (a tensor is a map-style dataset of its rows); every rank sees its own
        # shard through Lightning's DistributedSampler.
        return DataLoader(torch.randn(self.batches * 2 * 2, self.width), batch_size=2)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()


def full_parameters(module: torch.nn.Module, remove_duplicate: bool = True) -> Dict[str, torch.Tensor]:
    """Every rank's copy of the full, unflattened parameters and buffers, keyed like ``state_dict()``.

    Collective: call on all ranks. It reads the modules inside ``summon_full_params`` rather than calling
    ``state_dict()``, so it does not depend on the ``state_dict_on_rank_0_only`` behaviour under test.

    Args:
        module: the module, with or inside FSDP instances.
        remove_duplicate: ``False`` lists a parameter or buffer shared between modules under each of its names, as
            ``state_dict()`` does; ``True`` under the first only.
    """
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    instances = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
    inner = {id(m) for outer in instances for m in outer.modules() if m is not outer}
    with contextlib.ExitStack() as stack:
        for outermost in (m for m in instances if id(m) not in inner):
            stack.enter_context(outermost.summon_full_params(recurse=True, volatile=True))
        named = itertools.chain(
            module.named_parameters(remove_duplicate=remove_duplicate),
            module.named_buffers(remove_duplicate=remove_duplicate),
        )
        return {_clean_key(name): tensor.detach().clone().cpu() for name, tensor in named}


def optimizer_parameter_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> List[List[str]]:
    """For each parameter of ``optimizer``, in ``optimizer.state_dict()``'s order, the names (state-dict keys) of the
    original parameters it holds: several for an FSDP flat parameter, read from FairScale's own records of the
    flattened parameters, one for a parameter outside FSDP, none for one the module does not hold."""
    from fairscale.nn.misc import FlattenParamsWrapper

    names = {}
    for wrapper_name, wrapper in module.named_modules():
        if isinstance(wrapper, FlattenParamsWrapper):
            for flat in wrapper.flat_params:
                names[id(flat)] = [
                    _clean_key(".".join(part for part in (wrapper_name, module_name, name) if part))
                    for module_name, _, name in flat._param_infos
                ]
    names.update({id(p): [_clean_key(n)] for n, p in module.named_parameters() if id(p) not in names})
    return [names.get(id(p), []) for group in optimizer.param_groups for p in group["params"]]


def _clean_key(name: str) -> str:
    # FSDP and its FlattenParamsWrapper insert these two levels; state_dict() keys omit them.
    return ".".join(part for part in name.split(".") if part not in ("_fsdp_wrapped_module", "_fpw_module"))
