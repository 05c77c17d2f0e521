"""TRL's trainers with FSDP2: `FSDP2SFTTrainer` and `FSDP2DPOTrainer` (install the extra: `hf_fsdp2[trl]`).

Each is `FSDP2Mixin` placed before the TRL trainer, so what TRL does to the model in its own `__init__`
(`get_peft_model` for `peft_config`, its fused LM head) happens on the unsharded skeleton, and DPO's
reference model is sharded too (frozen, no optimizer state) instead of replicated on every rank.
"""

from __future__ import annotations

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("hf_fsdp2.trl needs TRL, which is an optional extra: pip install 'hf_fsdp2[trl]'") from error

from .trainer import FSDP2Mixin

__all__ = ["FSDP2DPOTrainer", "FSDP2SFTTrainer"]


class FSDP2SFTTrainer(FSDP2Mixin, SFTTrainer):
    """`trl.SFTTrainer` whose model (with its `peft_config` adapters) is sharded with FSDP2."""


class FSDP2DPOTrainer(FSDP2Mixin, DPOTrainer):
    """`trl.DPOTrainer` whose policy and reference models are sharded with FSDP2.

    With a PEFT policy there is no separate reference model: TRL disables the adapters to get it.
    """
