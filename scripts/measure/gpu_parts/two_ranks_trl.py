"""The TRL jobs of part "two_ranks" (hf_fsdp2.trl's trainers), written once for any world size like the others
(gpu_parts/two_ranks_jobs.py).

GRPO samples its completions, each rank its own, so its training is not compared: what is, is what it computes
deterministically, the policy's per-token log-probs of fixed ids and the reward model's scores of fixed completions
(TRL's own `_calculate_rewards`: each rank scores its contiguous slice and TRL gathers them in rank order).
"""

from __future__ import annotations

import math
from typing import Any

from gpu_parts.common import on_cuda
from gpu_parts.two_ranks_jobs import arguments, fresh_dir, fsdp2_config, model_path, outcome, rank, tokenizer, world

COMPLETIONS = 8  # per GRPO step, and scored by the reward model: 2 prompts x 4 generations


def words(generator: Any, n: int) -> str:
    import torch

    return " ".join(f"t{int(i)}" for i in torch.randint(3, 96, (n,), generator=generator))


def dpo(name: str) -> dict:
    """FSDP2DPOTrainer from the model's path: the frozen reference is a second sharded copy."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig

    from hf_fsdp2.trl import FSDP2DPOTrainer

    generator = torch.Generator().manual_seed(1)
    rows = [(words(generator, 4), words(generator, 5), words(generator, 5)) for _ in range(32)]
    pairs = Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})
    args = arguments(fresh_dir(name), DPOConfig, max_length=32, gradient_checkpointing=False)
    trainer = FSDP2DPOTrainer(
        model_path("llama"), args=args, train_dataset=pairs, processing_class=tokenizer(), fsdp2_config=fsdp2_config()
    )
    trainer.train()
    return outcome(trainer, name)


def grpo(name: str) -> dict:
    """FSDP2GRPOTrainer scored by the reward model's path: log-probs of fixed ids (before training), 2 steps of
    training, then the reward model's scores of fixed completions."""
    from datasets import Dataset
    from trl import GRPOConfig

    from hf_fsdp2.trl import FSDP2GRPOTrainer

    config = GRPOConfig(
        output_dir=fresh_dir(name), per_device_train_batch_size=COMPLETIONS // world(), num_generations=4,
        max_completion_length=8, learning_rate=1e-3, max_steps=2, logging_steps=1, report_to=[],
        use_cpu=not on_cuda(), save_strategy="no", seed=0, disable_tqdm=True,
        bf16=False, gradient_checkpointing=False,  # TRL's defaults; fp32 so that log-probs compare at 1e-5
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"t{5 + i % 40} t{6 + i % 40}" for i in range(64)]})
    trainer = FSDP2GRPOTrainer(
        model=model_path("llama"), reward_funcs=[model_path("reward")], reward_processing_classes=[tokenizer()],
        train_dataset=prompts, processing_class=tokenizer(), args=config, fsdp2_config=fsdp2_config(),
    )  # fmt: skip
    logps = fixed_logps(trainer)
    trainer.train()  # TRL's own steps: generation through the gathered model, the reward model under inference_mode
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "compared": {"log-probs": logps, "reward-model scores": fixed_scores(trainer)},
        "rewards": rewards,
        "checks": {"trained 2 steps, finite rewards": len(rewards) == 2 and all(map(math.isfinite, rewards))},
    }


def fixed_logps(trainer: Any) -> list[float]:
    """The policy's per-token log-probs of 4 fixed rows (one left-padded), the same rows on every rank."""
    import torch

    ids = torch.randint(3, 96, (4, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    device = trainer.accelerator.device
    with torch.no_grad():
        values = trainer._get_per_token_logps_and_entropies(trainer.model, ids.to(device), mask.to(device), 6)[0]
    return values.float().flatten().tolist()


def fixed_scores(trainer: Any) -> list[float]:
    """The reward model's scores of 8 fixed completions: this rank scores its slice, TRL gathers all 8."""
    prompts = [f"t{5 + i} t{6 + i}" for i in range(COMPLETIONS)]
    completions = [" " + " ".join(f"t{(7 * i + j) % 90 + 3}" for j in range(2 + i % 5)) for i in range(COMPLETIONS)]
    share = COMPLETIONS // world()
    mine = slice(rank() * share, (rank() + 1) * share)
    inputs = [{"prompt": p} for p in prompts[mine]]
    scores = trainer._calculate_rewards(inputs, prompts[mine], completions[mine], [[0]] * share)
    return scores.float().flatten().tolist()
