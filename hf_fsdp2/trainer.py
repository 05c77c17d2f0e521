"""FSDP2Trainer: a `transformers.Trainer` whose model is sharded with FSDP2 when the trainer is built.

This is the only module that knows Trainer/Accelerate internals. Every private hook it touches:
- `is_distributed_loading_by_transformers` (set after `__init__`): Trainer's path for models sharded
  before it sees them; `_prepare_for_training` then skips Accelerate's DDP/FSDP wrap.
  Guarded by tests/test_parity.py (a second wrap fails with "mixed torch.Tensor and DTensor").
  Set after `__init__` because `__init__` refuses checkpointing for transformers' own sharded models.
- `_defer_fsdp_gradient_reduction`: the no-sync context `_run_epoch` uses for such models; ours honours
  `FSDP2Config.defer_gradient_sync` (tests/test_parity.py, defer cases).
- `_move_model_to_device`: a no-op; sharding placed the model (moving DTensors would break offload).
- `_build_accelerator_args`: mixed_precision="no" so Accelerate adds no autocast; precision belongs to
  FSDP2's MixedPrecisionPolicy (tests/test_parity.py::bf16).
- `_clip_grad_norm` / `_get_grad_norm`: the global norm of DTensor gradients (tests/test_parity.py).
- `create_optimizer`: reshard first, because a forward under no_grad (evaluate) leaves the root gathered
  and an optimizer built then holds the wrong tensors (tests/test_trainer.py evaluate-then-train).
- `model_accepts_loss_kwargs`: cleared when the model's loss ignores `num_items_in_batch`, else
  Trainer multiplies such losses by the world size (tests/test_parity.py classification).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import set_seed

from .config import FSDP2Config
from .distributed import init_distributed
from .model import clip_grad_norm, prepare_model
from .sharding import reshard_all
from .skeleton import from_pretrained


class FSDP2Trainer(Trainer):
    """`Trainer` whose model is sharded with FSDP2 on construction: `Trainer(...)` → `FSDP2Trainer(...)`."""

    def __init__(
        self,
        model: nn.Module | str | os.PathLike | None = None,
        args: Optional[TrainingArguments] = None,
        *,
        fsdp2_config: Optional[FSDP2Config] = None,
        **trainer_kwargs: Any,
    ) -> None:
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        self.fsdp2_config = fsdp2_config if fsdp2_config is not None else FSDP2Config()
        _validate_args(model, args, self.fsdp2_config, trainer_kwargs)
        init_distributed()
        # Same seed as a single-process from_pretrained, so new heads are initialized identically.
        set_seed(args.seed)
        if isinstance(model, (str, os.PathLike)):
            model = from_pretrained(model)
        original_names = {id(p): name for name, p in model.named_parameters()}
        model = prepare_model(model, self.fsdp2_config, bf16=args.bf16, fp16=args.fp16)
        model._is_fsdp_managed_module = True
        optimizer, _ = trainer_kwargs.get("optimizers", (None, None))
        if optimizer is not None:
            repoint_optimizer(optimizer, original_names, model)
        super().__init__(model=model, args=args, **trainer_kwargs)
        self.is_distributed_loading_by_transformers = True
        if not _loss_uses_num_items(model):
            self.model_accepts_loss_kwargs = False

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Leave placement to sharding."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """Keep Accelerate's autocast out: FSDP2's MixedPrecisionPolicy owns precision."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"
        return accelerator_args

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        """Skip the reduction on non-final micro-steps only when the config asks for it."""
        if not self.fsdp2_config.defer_gradient_sync:
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shards."""
        return clip_grad_norm(list(model.parameters()), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Report the global gradient norm (measured without clipping when clipping is off)."""
        return grad_norm if grad_norm is not None else clip_grad_norm(list(model.parameters()), float("inf"))

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """Build the optimizer over the sharded parameters (reshard first: see module docstring)."""
        reshard_all(self.model)
        return super().create_optimizer(model)


def _validate_args(model: Any, args: TrainingArguments, config: FSDP2Config, kwargs: dict[str, Any]) -> None:
    """Reject combinations that would double-shard, double-checkpoint or silently diverge."""
    if model is None:
        raise ValueError("FSDP2Trainer needs `model`: a path to a Hugging Face model folder or an nn.Module.")
    if kwargs.get("model_init") is not None:
        raise ValueError("FSDP2Trainer does not support `model_init`; pass `model` (it is sharded once, up front).")
    if args.fsdp:
        raise ValueError(
            f"TrainingArguments(fsdp={args.fsdp!r}) asks Accelerate to shard the model too; remove it — "
            "FSDP2Trainer shards the model itself (configure it with FSDP2Config)."
        )
    if args.deepspeed:
        raise ValueError("TrainingArguments(deepspeed=...) cannot be combined with FSDP2Trainer; remove it.")
    if args.activation_checkpointing and config.activation_checkpointing:
        raise ValueError(
            "Both TrainingArguments(activation_checkpointing=True) and FSDP2Config(activation_checkpointing=True) "
            "are set; keep only FSDP2Config's, which checkpoints each FSDP unit."
        )


def repoint_optimizer(optimizer: torch.optim.Optimizer, original_names: dict[int, str], model: nn.Module) -> None:
    """Point an optimizer built over the unsharded parameters at the sharded ones, by name."""
    if optimizer.state:
        raise ValueError(
            "the optimizer passed in `optimizers` already has state (it has stepped); pass a fresh optimizer."
        )
    sharded = dict(model.named_parameters())
    current = {id(p) for p in sharded.values()}
    for group in optimizer.param_groups:
        params = []
        for index, param in enumerate(group["params"]):
            if id(param) in current:
                params.append(param)
                continue
            name = original_names.get(id(param))
            if name is None or name not in sharded:
                raise ValueError(
                    f"optimizer parameter #{index} (shape {tuple(param.shape)}) is not a parameter of the model "
                    "given to FSDP2Trainer; build the optimizer over that model's parameters."
                )
            params.append(sharded[name])
        group["params"] = params


def _loss_uses_num_items(model: nn.Module) -> bool:
    """False when the model's loss ignores `num_items_in_batch` (e.g. sequence classification)."""
    loss_function = getattr(model, "loss_function", None)
    if loss_function is None:
        return True
    try:
        parameters = inspect.signature(loss_function).parameters
    except (TypeError, ValueError):
        return True
    return "num_items_in_batch" in parameters
