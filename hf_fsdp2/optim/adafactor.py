"""Adafactor on FSDP2 shards, exact: transformers' Adafactor with its whole-matrix statistics summed over the group.

Adafactor is not elementwise: its factored second moment keeps a mean per row and per column of each matrix, and it
scales by the RMS of the weights and of the update. With rows split over ranks (Shard(0)) a row's mean is local,
while the column means, the mean of the row statistics and both RMS values need a sum over the shard group: four
all-reduces of a few numbers per matrix. Expert stacks split by experts keep every matrix whole, so only the RMS
values cross ranks. This module knows DTensors and transformers' Adafactor, not models or the Trainer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.optimization import Adafactor

from .row_shards import local_part, row_shard_group
from .twins import adopt_twin


class _Group:
    """Sums over the ranks a parameter's first dim is split across (nothing to sum when it is whole here)."""

    def __init__(self, param: torch.Tensor) -> None:
        found = row_shard_group(
            param,
            "Adafactor",
            "its row and column statistics are summed for rows split over ranks (Shard(0)) only. Drop "
            "shard_placement_fn, or use optim='adamw_torch'.",
        )
        self.group, self.mesh_dim = found if found is not None else (None, None)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the shard group, in place (NOTE: collective over that group)."""
        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor


def _rms(local: torch.Tensor, numel: int, group: _Group) -> torch.Tensor:
    """The RMS of the whole tensor from this rank's part."""
    return group.sum(local.square().sum()).div(numel).sqrt()


def _as_dtensor(local: torch.Tensor, param: torch.Tensor, shape: tuple[int, ...], split: bool) -> torch.Tensor:
    """State shaped `shape`, distributed like `param` along dim 0 when `split`, else replicated on the shard dim."""
    if not isinstance(param, DTensor):
        return local
    placements = [Shard(0) if (p.is_shard() and split) else Replicate() for p in param.placements]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, param.device_mesh, placements, shape=torch.Size(shape), stride=stride)


class ShardedAdafactor(Adafactor):
    """transformers.Adafactor, the same hyper-parameters and state names, stepping FSDP2 shards exactly."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Adafactor step; whole-matrix statistics are summed over each parameter's shard group."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(group, param)
        return loss

    def _step_one(self, group: dict[str, Any], param: torch.Tensor) -> None:
        """The arithmetic of transformers' Adafactor.step for one parameter, on this rank's rows."""
        ranks = _Group(param)
        grad = local_part(param.grad).float()
        weight = local_part(param)
        state = self._state(group, param, grad)
        local = {key: local_part(value) for key, value in state.items() if torch.is_tensor(value)}
        state["step"] += 1
        state["RMS"] = _rms(weight.float(), param.numel(), ranks)
        lr = self._get_lr(group, state)
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        update = grad.square() + group["eps"][0]
        if param.ndim >= 2:
            row, col = local["exp_avg_sq_row"], local["exp_avg_sq_col"]
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
            # Under Shard(0) a 2-D matrix's columns cross ranks: sum them there (a 3-D stack's are whole here).
            col_sum = update.sum(dim=-2)
            col_mean = (ranks.sum(col_sum) if param.ndim == 2 else col_sum) / param.shape[-2]
            col.mul_(beta2t).add_(col_mean, alpha=1.0 - beta2t)
            row_mean = row.mean(dim=-1, keepdim=True)
            if param.ndim == 2:  # the mean of the row statistics: over all rows of the matrix
                row_mean = ranks.sum(row.sum(dim=-1, keepdim=True)) / param.shape[0]
            update = (row / row_mean).rsqrt_().unsqueeze(-1).mul(col.unsqueeze(-2).rsqrt()).mul_(grad)
        else:
            local["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
            update = local["exp_avg_sq"].rsqrt().mul_(grad)
        update.div_((_rms(update, param.numel(), ranks) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if group["beta1"] is not None:
            update = local["exp_avg"].mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
        target = weight.float() if weight.dtype in (torch.float16, torch.bfloat16) else weight
        if group["weight_decay"] != 0:
            target.add_(target, alpha=-group["weight_decay"] * lr)
        target.add_(-update)
        if target is not weight:
            weight.copy_(target)

    def _state(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, created as transformers creates it, each tensor distributed like its param."""
        state = self.state[param]
        if state:
            return state
        state["step"] = 0
        if group["beta1"] is not None:
            state["exp_avg"] = _as_dtensor(torch.zeros_like(grad), param, tuple(param.shape), split=True)
        if param.ndim >= 2:
            # NOTE: on the gradient's device (the accelerator): its row sums are all-reduced over the shard group.
            rows, cols = grad.new_zeros(grad.shape[:-1]), grad.new_zeros(grad.shape[:-2] + grad.shape[-1:])
            state["exp_avg_sq_row"] = _as_dtensor(rows, param, tuple(param.shape[:-1]), split=True)
            # A 2-D matrix's column statistics are the same on every rank; a stack's are split by experts.
            state["exp_avg_sq_col"] = _as_dtensor(
                cols, param, tuple(param.shape[:-2] + param.shape[-1:]), param.ndim > 2
            )
        else:
            state["exp_avg_sq"] = _as_dtensor(torch.zeros_like(grad), param, tuple(param.shape), split=True)
        state["RMS"] = 0
        return state


def make_adafactor_exact(optimizer: torch.optim.Optimizer) -> None:
    """Turn transformers' Adafactor, or a subclass that keeps its step, into ShardedAdafactor in place.

    Raises:
        ValueError: for a subclass that overrides `step` (`twins.adopt_twin`).
    """
    adopt_twin(optimizer, Adafactor, ShardedAdafactor)
