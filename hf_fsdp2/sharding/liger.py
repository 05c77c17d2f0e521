"""Liger's kernels (`TrainingArguments(use_liger_kernel=True)`) on a model FSDP2 shards: where they can run, and that
the fused linear cross-entropy reads the LM head gathered.

Liger (liger-kernel 0.8.5, `_apply_liger_kernel_to_instance`) only rebinds forwards on the model instance: each
RMSNorm's and MLP's `forward` becomes a Triton kernel's, and a causal LM's own `forward` becomes `lce_forward`, which
computes the loss from the last hidden states and `self.lm_head.weight` without making the logits. FSDP2's hooks are
module hooks around whatever `forward` is bound, so Trainer applies Liger in `train()` to the sharded model as it does
to any other. `lce_forward` is the root unit's forward: there the root's parameters (embedding, final norm, the head,
tied or not) are gathered, in the compute dtype, and the kernel reads the whole head. That holds only while the head
belongs to the root unit and is a plain `Linear` (a PEFT-wrapped head's `.weight` is its frozen base weight: the
adapter would be left out, which is why TRL refuses it too). It knows modules and units, not the Trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import FSDP2Config
from ..loading.facts import unwrap_peft


def check_liger_machine(device: torch.device) -> None:
    """Refuse Liger where its kernels cannot run.

    Raises:
        ValueError: without a CUDA device (Liger's Triton kernels need Triton's GPU backend), or without liger-kernel.
    """
    if device.type != "cuda":
        raise ValueError(
            "TrainingArguments(use_liger_kernel=True): Liger's kernels are Triton kernels, which need Triton's GPU "
            "backend, and this machine has no CUDA device. Turn use_liger_kernel off; FSDP2Config(loss_chunk_size=...) "
            "computes the LM head and loss in chunks on any device."
        )
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        raise ValueError("TrainingArguments(use_liger_kernel=True) needs liger-kernel: pip install liger-kernel.")


def check_liger_model(
    model: nn.Module, units: list[nn.Module], kernel_config: dict[str, Any] | None, config: FSDP2Config
) -> None:
    """Refuse the models and settings under which Liger's fused linear cross-entropy would read a head that is not
    whole in the root unit's forward, or would replace another fused loss.

    Raises:
        ValueError: naming the LM head's wrapper or unit, or the FSDP2Config setting, and the fix.
    """
    if not (kernel_config or {}).get("fused_linear_cross_entropy", True):
        return  # the layer kernels only: the head and the loss stay the model's own
    if config.effective_loss_chunk_size is not None:
        raise ValueError(
            "TrainingArguments(use_liger_kernel=True) with FSDP2Config(loss_chunk_size="
            f"{config.effective_loss_chunk_size}) (or sequence_parallel_size > 1, which turns it on): both replace the "
            "LM head and loss with a fused one. Keep one, or pass liger_kernel_config={'fused_linear_cross_entropy': "
            "False} to keep only Liger's layer kernels."
        )
    head = _output_embeddings(model)
    if head is None:
        return
    if type(head) is not nn.Linear:
        raise ValueError(
            f"TrainingArguments(use_liger_kernel=True): the LM head is a {type(head).__module__}."
            f"{type(head).__qualname__} (LoRA on lm_head, "
            "modules_to_save or trainable tokens), and Liger's fused loss reads lm_head.weight, the frozen base "
            "weight, leaving the adapter out (TRL refuses it too). Keep lm_head out of the adapter, or pass "
            "liger_kernel_config={'fused_linear_cross_entropy': False}."
        )
    names = {id(m): n for n, m in model.named_modules()}
    holder = next((unit for unit in units if any(m is head for m in unit.modules())), None)
    if holder is not None:
        raise ValueError(
            f"TrainingArguments(use_liger_kernel=True): the LM head is inside the FSDP unit {names[id(holder)]!r}, not "
            "the root, and Liger's fused loss reads its weight in the root's forward, where that unit is sharded. Keep "
            "the head out of the wrap policy (the default policy wraps only the decoder blocks), or pass "
            "liger_kernel_config={'fused_linear_cross_entropy': False}."
        )


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's LM head module (None for a model without one)."""
    base = unwrap_peft(model)
    get = getattr(base, "get_output_embeddings", None)
    return get() if callable(get) else None
