"""fp16's gradient scaler over sharded gradients: one inf/NaN check for the whole model, the same skip on every rank.

Each rank holds only its shard of each gradient, so an overflow lives on one rank; every rank must still skip the
step (and halve the scale) alike, or the ranks' shards drift apart. torch 2.13's `GradScaler` reduces its check over a
DTensor gradient's mesh, but a gradient list that mixes DTensors with plain tensors (0-dim parameters, which
`fully_shard` leaves whole) fails there, in torch's `ShardedGradScaler` too ("'Tensor' object has no attribute
'placements'", measured at 2 ranks). This scaler checks each rank's local shards and agrees on one flag over all ranks
(`distributed.agree`). It knows gradients and ranks, not the Trainer or checkpoints.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..distributed import agree


class AgreedGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose inf/NaN check covers every rank's gradient shards, so every rank skips alike.

    Its state (`state_dict`) is torch's, so a `scaler.pt` written by Trainer under DDP loads here and back.

    NOTE: `unscale_` is a collective over all ranks; every rank calls it at the same steps (Trainer does, before
    clipping and in `step`).
    """

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._overflowed: dict[int, bool] = {}  # per optimizer since the last update(): the agreed decision

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's local shards; `found_inf` becomes the flag every rank agrees on (any rank's overflow).

        torch's own extension point (its ShardedGradScaler overrides it too): `unscale_` calls it once per step.
        """
        local_flags = []
        with torch.no_grad():
            for (device, _), grads in _local_grads(optimizer, allow_fp16).items():
                flag = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
                local_flags.append(flag.to(found_inf.device))
        overflowed = bool(torch.stack(local_flags).amax().item()) if local_flags else False
        overflowed = agree([float(overflowed)], "max")[0] > 0  # NOTE: collective: every rank, every unscale_
        found_inf.fill_(float(overflowed))
        self._overflowed[id(optimizer)] = overflowed
        return {found_inf.device: found_inf}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step unless any rank's gradients overflowed; then no rank steps (the optimizer is not called at all, so
        Accelerate reports the step as skipped and Trainer leaves the learning-rate schedule where it was)."""
        if not self.is_enabled():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if id(optimizer) not in self._overflowed:
            self.unscale_(optimizer)
        if self._overflowed[id(optimizer)]:
            return None
        # NOTE: the gradients are unscaled already, so a fused optimizer gets no grad_scale/found_inf to apply.
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Grow or back off the scale from the agreed decision (identical on every rank), and start a new step."""
        super().update(new_scale)
        self._overflowed.clear()


def _local_grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> dict[tuple[Any, Any], list[torch.Tensor]]:
    """This rank's part of each gradient (a DTensor's local shard), grouped by device and dtype for the foreach kernel.

    Raises:
        ValueError: for an fp16 gradient when `allow_fp16` is False (fp32 masters get fp32 gradients), or a sparse one.
    """
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.is_sparse:
                raise ValueError("sparse gradients cannot be unscaled over shards; FSDP2 never makes them.")
            if not allow_fp16 and local.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # torch's own message
            groups[(local.device, local.dtype)].append(local)
    return groups
