"""Precision for `FSDP2Mixin`: fp16 training with a gradient scaler every rank agrees on, and evaluation in bf16 or
fp16 (`bf16_full_eval`, `fp16_full_eval`) through the units' compute dtype, never by casting the fp32 masters.

It decides when the model computes in which dtype and how the loss is scaled; the units' dtypes are `sharding.units`'
and `sharding.compute_dtype`'s, the scaler's check over shards `optim.grad_scaler`'s. Every private Trainer/Accelerate
hook it touches:
- `Accelerator.scaler` (set after `create_accelerator_and_postprocess`): Accelerate builds no scaler for us (its
  mixed precision is "no": FSDP2's policy owns precision); `accelerator.backward` scales the loss with the one set
  here, and `accelerator.prepare(optimizer)` hands it to `AcceleratedOptimizer`, whose `step` runs `scaler.step` and
  `update` and reports a skipped step to Trainer (`optimizer_step_was_skipped`: no scheduler step).
  `Accelerator.scaler_handler` (Accelerate's `GradScalerKwargs`, public) configures it (tests/test_switches.py).
- `_clip_grad_norm` / `_get_grad_norm`: the gradients are unscaled first, as `accelerator.clip_grad_norm_` does
  under DDP (tests/test_switches.py fp16 parity, overflow).
- `_save_scaler` (Trainer's, called from `checkpointing._save_checkpoint_files`) writes `scaler.pt`; Trainer's own
  `_prepare_for_training` reads it back through `_load_scaler`, which skips a `scaler.pt` when this run has no
  scaler (tests/test_switches.py resume).
- `evaluation_loop` (wrapped, with bf16_full_eval or fp16_full_eval): the units compute in that dtype inside it, and
  Trainer's own flags are off for the call, so its `model.to(dtype)` (the masters included) never runs. Unlike plain
  Trainer, which casts only outside `train()`, evaluations during training run in that dtype too
  (tests/test_switches.py full_eval).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.trainer import SCALER_NAME

from ..distributed import get_device, warn_rank0
from ..optim.grad_scaler import AgreedGradScaler
from ..sharding.compute_dtype import computing_in
from ..sharding.units import mixed_precision_policy
from .step import unwrap_optimizer


class PrecisionMixin:
    """`FSDP2Mixin`'s precision: fp16's gradient scaler (held by Accelerate as `accelerator.scaler`), unscaled before
    the norm is taken, saved in and resumed from checkpoints; evaluation in the full-eval dtype. Reads
    `fsdp2_config`."""

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's evaluation, computing in bf16/fp16 under bf16_full_eval/fp16_full_eval (the masters untouched)."""
        dtype = torch.float16 if self.args.fp16_full_eval else torch.bfloat16 if self.args.bf16_full_eval else None
        if dtype is None:
            return super().evaluation_loop(*args, **kwargs)
        with computing_in(self.model, dtype), _without_full_eval_casts(self.args):
            return super().evaluation_loop(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """Give Accelerate our scaler when the units compute in fp16."""
        super().create_accelerator_and_postprocess()
        if self._computes_in_fp16():
            handler = self.accelerator.scaler_handler
            kwargs = handler.to_kwargs() if handler is not None else {}
            self.accelerator.scaler = AgreedGradScaler(get_device().type, **kwargs)

    def _computes_in_fp16(self) -> bool:
        """True when the sharded units compute in fp16 (fp16=True, or FSDP2Config(param_dtype='float16'))."""
        policy = mixed_precision_policy(self.fsdp2_config, bf16=self.args.bf16, fp16=self.args.fp16)
        return policy.param_dtype == torch.float16

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Unscale the gradients, then clip by their global norm."""
        self._unscale_gradients()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The global norm of the unscaled gradients (Trainer asks without a norm only when it did not clip)."""
        if grad_norm is None:
            self._unscale_gradients()
        return super()._get_grad_norm(model, grad_norm)

    def _unscale_gradients(self) -> None:
        """Divide the gradients by the loss scale and agree over ranks whether any overflowed (a collective)."""
        scaler = self.accelerator.scaler
        if scaler is not None and self.optimizer is not None:
            scaler.unscale_(unwrap_optimizer(self.optimizer))

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Trainer's resume of `scaler.pt`, skipped (with a warning) when this run computes in another dtype."""
        if self.accelerator.scaler is not None or checkpoint is None:
            return super()._load_scaler(checkpoint)
        if os.path.isfile(os.path.join(checkpoint, SCALER_NAME)):
            warn_rank0(
                "%s holds an fp16 gradient scaler (%s) but this run does not compute in fp16: the scaler is not used.",
                checkpoint,
                SCALER_NAME,
            )


@contextlib.contextmanager
def _without_full_eval_casts(args: Any) -> Iterator[None]:
    """Trainer's full-eval flags off for the block: its evaluation_loop would cast the model in place with them."""
    saved = args.fp16_full_eval, args.bf16_full_eval
    args.fp16_full_eval = args.bf16_full_eval = False
    try:
        yield
    finally:
        args.fp16_full_eval, args.bf16_full_eval = saved
