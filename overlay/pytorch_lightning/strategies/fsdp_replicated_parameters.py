"""Replicated parameters: the LightningModule's parameters outside every FSDP instance are broadcast from global
rank 0 at setup and their gradients averaged before each optimizer step, as DDP does.

The hooks are ``DDPFullyShardedStrategy``'s base class and ``configure_ddp``.
"""
# fork-feature: fork/fsdp-sync-replicated-gradients.patch
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import pytorch_lightning as pl
from pytorch_lightning.overrides.fairscale import _FAIRSCALE_FULLY_SHARDED_AVAILABLE
from pytorch_lightning.strategies.ddp import DDPStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

if _FAIRSCALE_FULLY_SHARDED_AVAILABLE:
    from fairscale.nn.data_parallel import FullyShardedDataParallel


class FSDPReplicatedParametersMixin(DDPStrategy):
    """Methods of ``DDPFullyShardedStrategy`` that keep the parameters outside FSDP equal on every rank."""

    def _setup_replicated_parameters(self) -> None:
        """Find the parameters of the LightningModule that no FSDP instance manages, make them equal on every
        rank, as DDP does when it wraps a module, and warn about the trainable ones that they are replicated.

        Frozen ones are included: a callback such as ``BackboneFinetuning`` may unfreeze them later.
        """
        managed = {
            id(p) for m in self.lightning_module.modules() if isinstance(m, FullyShardedDataParallel) for p in m.params
        }
        named = [(n, p) for n, p in self.lightning_module.named_parameters() if id(p) not in managed]
        self._replicated_parameters = [p for _, p in named]
        if not named:
            return
        if self._is_distributed_run():
            with torch.no_grad():
                for param in self._replicated_parameters:
                    # collectives run on the root device: with ``cpu_offload`` these parameters stay on the CPU
                    data = param.data.to(self.root_device)
                    torch.distributed.broadcast(data, src=0, group=self.process_group)
                    param.data.copy_(data)
        names = [n for n, p in named if p.requires_grad]
        if not names:
            return
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        rank_zero_warn(
            f"{len(names)} trainable parameter(s) of the LightningModule are not managed by any FSDP instance: {shown}."
            " `DDPFullyShardedStrategy` replicates them instead of sharding them: every rank holds a full copy and its"
            " optimizer state, the copies start from global rank 0's values, and their gradients are averaged over"
            " the ranks before each optimizer step. Wrap them with `wrap` in `configure_sharded_model` to shard them."
        )

    def _is_distributed_run(self) -> bool:
        return self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    def sync_replicated_gradients(self, optimizer: Optimizer) -> None:
        """Average the gradients of the replicated parameters of ``optimizer`` over the ranks.

        FSDP reduces the gradients of the parameters it manages during the backward pass; the LightningModule's
        other trainable parameters (outside every FSDP instance) would otherwise train a different copy on every rank.
        With automatic optimization this runs once per optimizer step, after the backward pass of the last
        accumulated batch and before gradient clipping. With manual optimization it runs in ``optimizer.step()``;
        if you clip gradients yourself, call it before clipping. Calling it twice does no harm. Unlike DDP's, the
        averaging happens after ``on_after_backward``, which sees each rank's own gradients. This is a collective
        call: all ranks must call it.

        Args:
            optimizer: the optimizer whose replicated parameters are synchronised.
        """
        if not self._replicated_parameters or not self._is_distributed_run():
            return
        replicated = {id(p) for p in self._replicated_parameters}
        params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in replicated]
        if not params:
            return
        # A parameter without a gradient on every rank (unused) keeps none, so the optimizer skips it as usual.
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.root_device)
        torch.distributed.all_reduce(has_grad, group=self.process_group)
        params = [p for p, count in zip(params, has_grad.tolist()) if count]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        buckets: Dict[Any, List[torch.nn.Parameter]] = {}
        for param in params:
            if param.grad.is_sparse:
                # e.g. ``nn.Embedding(sparse=True)``: reduced densely, handed back sparse
                dense = param.grad.to_dense().to(self.root_device)
                torch.distributed.all_reduce(dense, group=self.process_group)
                param.grad = (dense / self.world_size).to(param.grad.device).to_sparse()
                continue
            buckets.setdefault((param.grad.device, param.grad.dtype), []).append(param)
        for bucket in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]).to(self.root_device)
            torch.distributed.all_reduce(flat, group=self.process_group)
            flat /= self.world_size
            for param, grad in zip(bucket, flat.split([p.numel() for p in bucket])):
                param.grad.copy_(grad.view_as(param.grad))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        opt_idx: int,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Performs the actual optimizer step, averaging the gradients of replicated parameters (see
        :meth:`sync_replicated_gradients`) after ``closure`` ran the backward pass.

        Args:
            optimizer: the optimizer performing the step
            opt_idx: index of the current optimizer
            closure: closure calculating the loss value
            model: reference to the model, optionally defining optimizer step related hooks
            **kwargs: Any extra arguments to ``optimizer.step``
        """
        if not self._replicated_parameters:
            return super().optimizer_step(optimizer, opt_idx, closure, model, **kwargs)

        def closure_and_sync() -> Any:
            # the precision plugin runs this before ``on_before_optimizer_step``, gradient clipping and the step
            result = closure()
            self.sync_replicated_gradients(optimizer)
            return result

        return super().optimizer_step(optimizer, opt_idx, closure_and_sync, model, **kwargs)
