"""Where `FSDP2Mixin` resumes: sharded checkpoints read back at any world size, and a finished run relaunched.

Which checkpoint `"auto"` picks is `checkpoints.resume`'s, the DCP reads `checkpoints.sharded_resume`'s. Every
private Trainer hook it touches:
- `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_best_model`: DCP loads, any world
  size (tests/test_checkpoint.py resume cases). `_load_rng_state` is Trainer's own.
- `_init_training_state`: a resumed checkpoint that already reached max_steps trains no further (Trainer
  would run one more step at learning rate 0 and write another checkpoint); the epoch loop is skipped and
  only the end of training (export) runs (tests/test_checkpoint.py relaunch of a finished run).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers.trainer import SCHEDULER_NAME

from ..checkpoints.adapters import load_adapter
from ..checkpoints.sharded_resume import resume_model, resume_optimizer
from ..distributed import warn_rank0
from ..loading.facts import facts_of
from .step import unwrap_optimizer


class ResumeMixin:
    """`FSDP2Mixin`'s resume. It keeps no state of its own: what it reads is in the checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load the sharded model (a PEFT model: its adapters) from checkpoint-N, whatever world size wrote it."""
        if facts_of(self.model).is_peft:
            load_adapter(self.model, resume_from_checkpoint)
        else:
            resume_model(self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore optimizer (DCP, resharded) and scheduler state."""
        if checkpoint is None:
            return
        resume_optimizer(self.model, unwrap_optimizer(self.optimizer), checkpoint)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        """Reload the best checkpoint's weights into the sharded model."""
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """Trainer's state, restored from the checkpoint; a finished run's epochs all count as trained."""
        epochs_trained, steps_in_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is None or self.state.global_step < max_steps:
            return epochs_trained, steps_in_epoch
        # A warning, not info: a train() call that trains nothing should be visible at the default verbosity.
        warn_rank0(
            "%s already reached max_steps=%d: nothing left to train, no new checkpoint; only the end of training "
            "runs again (export, best model).",
            resume_from_checkpoint,
            max_steps,
        )
        return num_train_epochs, 0
