"""TRL GRPO (online RL) as people write it, with FSDP2GRPOTrainer, on a learnable toy task.

Usage: grpo_worker.py {plain,fsdp2} OUT MODEL [SCENARIO ...] [--reward-checkpoint PATH]; rank 0 writes
OUT/{MODE}-{WORLD}.json.
The task: prompts of two tokens; the reward is the share of completion tokens from the lower half of the
vocabulary (t3..t47): about 0.47 for a random model, 1.0 once learned.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from torch.distributed.fsdp import FSDPModule
from trl import GRPOConfig, GRPOTrainer

from tests.tiny_models import tiny_tokenizer
from tests.workers.scenarios import run_scenarios

MODE, OUT, MODEL = sys.argv[1:4]
CHOSEN = sys.argv[4:]
REWARD_CHECKPOINT = ""
if "--reward-checkpoint" in CHOSEN:
    at = CHOSEN.index("--reward-checkpoint")
    REWARD_CHECKPOINT = CHOSEN[at + 1]
    del CHOSEN[at : at + 2]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")
GLOBAL_BATCH = 8  # completions per step: 2 prompts x 4 generations


def reward_low_half(completions: list[str], **kwargs: Any) -> list[float]:
    """Share of the completion's tokens from t3..t47."""

    def low(word: str) -> bool:
        return word.startswith("t") and word[1:].isdigit() and int(word[1:]) < 48

    return [sum(low(w) for w in c.split()) / max(len(c.split()), 1) for c in completions]


def prompts(n: int = 512) -> Dataset:
    return Dataset.from_dict({"prompt": [f"t{5 + i % 40} t{6 + i % 40}" for i in range(n)]})


def config(name: str, kind: type = GRPOConfig, **overrides: Any) -> GRPOConfig:
    values: dict[str, Any] = dict(
        output_dir=os.path.join(RUN_DIR, name), per_device_train_batch_size=GLOBAL_BATCH // WORLD,
        num_generations=4, max_completion_length=8, learning_rate=3e-2, max_steps=30, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
        # TRL's defaults are bf16=True and gradient checkpointing: fp32 here, so log-probs compare to 1e-5.
        bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    values.update(overrides)
    return kind(**values)


def trainer(name: str, **kwargs: Any) -> GRPOTrainer:
    common = dict(model=MODEL, reward_funcs=reward_low_half, train_dataset=prompts(), processing_class=tiny_tokenizer())
    if MODE == "plain":
        return GRPOTrainer(args=config(name, **kwargs.pop("args", {})), **common, **kwargs)
    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.trl import FSDP2GRPOTrainer

    fsdp2 = FSDP2Config(consolidate_on_train_end=False, checkpoint_on_signals=[])
    return FSDP2GRPOTrainer(args=config(name, **kwargs.pop("args", {})), fsdp2_config=fsdp2, **common, **kwargs)


def rewards(run: GRPOTrainer) -> list[float]:
    return [h["reward"] for h in run.state.log_history if "reward" in h]


def full() -> dict[str, Any]:
    """30 steps of full GRPO: the reward must rise."""
    run = trainer("full")
    run.train()
    return {"rewards": rewards(run), "sharded": isinstance(run.model, FSDPModule)}


def lora() -> dict[str, Any]:
    """GRPO with peft_config: the adapters train (on this toy, LoRA's reward moves little in 30 steps, in one
    process as here), and checkpoints hold the adapter only."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_config = LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    run = trainer("lora", peft_config=lora_config, args=dict(save_strategy="steps", save_steps=10, max_steps=10))
    run.train()
    checkpoint = os.path.join(RUN_DIR, "lora", "checkpoint-10")
    lora_b = sum(float(p.full_tensor().abs().sum()) for n, p in run.model.named_parameters() if "lora_B" in n)
    return {
        "rewards": rewards(run),
        "lora_b_abs_sum": lora_b,  # 0 at initialization: the adapters trained
        "files": sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else [],
    }


def resume() -> dict[str, Any]:
    """LoRA GRPO stopped after step 2 and relaunched with resume_from_checkpoint='auto', against 4 steps in one go."""
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    lora_config = LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    whole = trainer("resume_whole", peft_config=lora_config, args=dict(max_steps=4))
    whole.train()
    first = trainer("resume", peft_config=lora_config, args=dict(max_steps=2, save_strategy="steps", save_steps=2))
    first.train()
    again = trainer("resume", peft_config=lora_config, args=dict(max_steps=4, save_strategy="steps", save_steps=2))
    # "auto" is hf_fsdp2's (the newest complete checkpoint); plain Trainer is given the folder.
    again.train(resume_from_checkpoint="auto" if MODE == "fsdp2" else os.path.join(RUN_DIR, "resume", "checkpoint-2"))
    return {
        "whole": rewards(whole),
        "resumed": rewards(again),
        "global_step": again.state.global_step,
        "checkpoints": sorted(d for d in os.listdir(os.path.join(RUN_DIR, "resume")) if d.startswith("checkpoint")),
    }


def reference() -> dict[str, Any]:
    """beta > 0: a reference model beside the policy, sharded frozen."""
    run = trainer("reference", args=dict(beta=0.04, max_steps=3))
    run.train()
    ref = run.ref_model
    return {
        "rewards": rewards(run),
        "kl": [h["kl"] for h in run.state.log_history if "kl" in h],
        "ref_sharded": isinstance(ref, FSDPModule),
        "ref_trainable": sum(p.requires_grad for p in ref.parameters()),
    }


def logps() -> dict[str, Any]:
    """Per-token log-probs GRPO computes for fixed prompt + completion ids (the same on every rank)."""
    run = trainer("logps", args=dict(max_steps=1))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 96, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    with torch.no_grad():
        values = run._get_per_token_logps_and_entropies(run.model, ids, mask, logits_to_keep=6)[0]
    return {"logps": values.float().tolist()}


def scored_by_reward_models(kind: str) -> dict[str, Any]:
    """TRL's own `_calculate_rewards` with reward models (`kind`: GRPO given the checkpoint's path, RLOO given the
    model object) beside a function, on fixed completions: each rank scores its contiguous slice and TRL gathers
    them in rank order, so every world size scores the same 8 texts. Then one training step, in which the reward
    models' first forward runs under TRL's torch.inference_mode()."""
    from transformers import AutoModelForSequenceClassification
    from trl import RLOOConfig, RLOOTrainer

    from hf_fsdp2.trl import FSDP2GRPOTrainer, FSDP2RLOOTrainer

    plain, ours, config_class = (GRPOTrainer, FSDP2GRPOTrainer, GRPOConfig) if kind == "grpo" else (
        RLOOTrainer, FSDP2RLOOTrainer, RLOOConfig)  # fmt: skip
    scorer = REWARD_CHECKPOINT if kind == "grpo" else AutoModelForSequenceClassification.from_pretrained(
        REWARD_CHECKPOINT, num_labels=1)  # fmt: skip
    tokenizer = tiny_tokenizer()
    kwargs = dict(
        model=MODEL, reward_funcs=[scorer, reward_low_half], reward_processing_classes=[tokenizer, None],
        train_dataset=prompts(), processing_class=tokenizer, args=config(f"scored_{kind}", config_class, max_steps=1),
    )  # fmt: skip
    if MODE == "plain":
        run = plain(**kwargs)
    else:
        from hf_fsdp2 import FSDP2Config

        run = ours(fsdp2_config=FSDP2Config(consolidate_on_train_end=False, checkpoint_on_signals=[]), **kwargs)
    run.train()  # first: TRL's own step, under its inference_mode
    texts = [f"t{5 + i} t{6 + i}" for i in range(8)], [" " + " ".join(f"t{(7 * i + j) % 90 + 3}" for j in range(
        2 + i % 5)) for i in range(8)]  # fmt: skip
    rank, share = int(os.environ.get("RANK", "0")), 8 // WORLD
    mine = slice(rank * share, (rank + 1) * share)
    prompts_, completions = texts[0][mine], texts[1][mine]
    inputs = [{"prompt": p} for p in prompts_]
    scores = run._calculate_rewards(inputs, prompts_, completions, [[0]] * len(prompts_))
    model = run.reward_funcs[0]
    return {
        "scores": scores.float().tolist(),  # 8 rows x (reward model, function)
        "step_rewards": [h[k] for h in run.state.log_history for k in h if k.startswith("rewards/") and "mean" in k],
        "fsdp2_only": {
            "sharded": isinstance(model, FSDPModule),
            "trainable": sum(p.requires_grad for p in model.parameters()),
        },  # fmt: skip
    }


def rloo() -> dict[str, Any]:
    """RLOO through the mixin (FSDP2RLOOTrainer), the same task: its reward rises too."""
    from trl import RLOOConfig, RLOOTrainer

    common = dict(model=MODEL, reward_funcs=reward_low_half, train_dataset=prompts(), processing_class=tiny_tokenizer())
    if MODE == "plain":
        run = RLOOTrainer(args=config("rloo", RLOOConfig), **common)
    else:
        from hf_fsdp2 import FSDP2Config
        from hf_fsdp2.trl import FSDP2RLOOTrainer

        fsdp2 = FSDP2Config(consolidate_on_train_end=False, checkpoint_on_signals=[])
        run = FSDP2RLOOTrainer(args=config("rloo", RLOOConfig), fsdp2_config=fsdp2, **common)
    run.train()
    return {"rewards": rewards(run)}


def online_dpo() -> dict[str, Any]:
    """Online DPO (trl.experimental) through FSDP2Mixin as a user writes it: two completions per prompt, the
    reward function picks the chosen one; the mean score of the sampled completions rises (one process: 0.41 to
    0.99)."""
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    values = dict(
        output_dir=os.path.join(RUN_DIR, "online_dpo"), per_device_train_batch_size=GLOBAL_BATCH // WORLD,
        max_new_tokens=8, learning_rate=3e-2, max_steps=20, beta=[0.01], logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    common = dict(model=MODEL, reward_funcs=reward_low_half, train_dataset=prompts(), processing_class=tiny_tokenizer())
    if MODE == "plain":
        run = OnlineDPOTrainer(args=OnlineDPOConfig(**values), **common)
    else:
        from hf_fsdp2 import FSDP2Config, FSDP2Mixin

        class FSDP2OnlineDPOTrainer(FSDP2Mixin, OnlineDPOTrainer):
            pass

        fsdp2 = FSDP2Config(consolidate_on_train_end=False, checkpoint_on_signals=[])
        run = FSDP2OnlineDPOTrainer(args=OnlineDPOConfig(**values), fsdp2_config=fsdp2, **common)
    run.train()
    history = run.state.log_history
    return {
        "scores": [h["objective/scores"] for h in history if "objective/scores" in h],
        "sharded": isinstance(run.model, FSDPModule),
        "ref_sharded": isinstance(run.ref_model, FSDPModule),
    }


SCENARIOS = {
    **{"full": full, "lora": lora, "resume": resume, "reference": reference, "logps": logps, "rloo": rloo},
    "online_dpo": online_dpo,
    "reward_model_grpo": lambda: scored_by_reward_models("grpo"),
    "reward_model_rloo": lambda: scored_by_reward_models("rloo"),
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    os.makedirs(RUN_DIR, exist_ok=True)
    run_scenarios(SCENARIOS, CHOSEN, f"{RUN_DIR}.json")
