"""TRL's trainers with FSDP2: `FSDP2SFTTrainer`, `FSDP2DPOTrainer`, `FSDP2KTOTrainer`, `FSDP2RewardTrainer`,
`FSDP2GRPOTrainer` and `FSDP2RLOOTrainer` (install the extra: `hf_fsdp2[trl]`).

Each is `FSDP2Mixin` placed before the TRL trainer, so what TRL does to the model in its own `__init__`
(`get_peft_model` for `peft_config`, its fused LM head) happens on the unsharded skeleton, and DPO's and KTO's
reference models are sharded too (frozen, no optimizer state) instead of replicated on every rank. A model given as a
path is built by TRL itself, in the class and configuration it asks for (RewardTrainer's `num_labels=1` classifier,
`model_init_kwargs`), as our meta skeleton: each rank reads only its slices (`hf_fsdp2.loading.path_models`).
GRPO's generation goes through the sharded model's `generate`, which gathers every unit once per call
(`hf_fsdp2.gathered`).
"""

from __future__ import annotations

try:
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("hf_fsdp2.trl needs TRL, which is an optional extra: pip install 'hf_fsdp2[trl]'") from error

from .trainer.mixin import FSDP2Mixin

__all__ = [
    "FSDP2DPOTrainer",
    "FSDP2GRPOTrainer",
    "FSDP2KTOTrainer",
    "FSDP2RLOOTrainer",
    "FSDP2RewardTrainer",
    "FSDP2SFTTrainer",
]


class FSDP2SFTTrainer(FSDP2Mixin, SFTTrainer):
    """`trl.SFTTrainer` whose model (with its `peft_config` adapters) is sharded with FSDP2."""


class FSDP2DPOTrainer(FSDP2Mixin, DPOTrainer):
    """`trl.DPOTrainer` whose policy and reference models are sharded with FSDP2.

    With a PEFT policy there is no separate reference model: TRL disables the adapters to get it.
    """


class FSDP2KTOTrainer(FSDP2Mixin, KTOTrainer):
    """`trl.KTOTrainer` whose policy and reference models are sharded with FSDP2, as `FSDP2DPOTrainer`.

    KTO's KL term pairs each rank's own rows, so at N ranks it trains as TRL does under DDP at N ranks.
    """


class FSDP2RewardTrainer(FSDP2Mixin, RewardTrainer):
    """`trl.RewardTrainer` whose reward model is sharded with FSDP2; given a path (a causal LM or a classifier
    checkpoint), TRL's own `num_labels=1` classifier is what gets built and sharded."""


class FSDP2GRPOTrainer(FSDP2Mixin, GRPOTrainer):
    """`trl.GRPOTrainer` (online RL: generate, score, update) whose policy is sharded with FSDP2.

    Completions are generated on the sharded policy with every unit gathered once per generation; with `beta > 0`
    the reference model is sharded frozen, as DPO's; with `peft_config`, checkpoints hold the adapter only.
    """


class FSDP2RLOOTrainer(FSDP2Mixin, RLOOTrainer):
    """`trl.RLOOTrainer` (REINFORCE leave-one-out) whose policy is sharded with FSDP2, as `FSDP2GRPOTrainer`."""
