"""TRL GRPO with real vLLM generating (colocate), plain TRL against FSDP2GRPOTrainer (tests/test_vllm.py).

Usage: vllm_worker.py {plain,fsdp2} OUT MODEL SCENARIO...; rank 0 writes OUT/{MODE}-{WORLD}.json. Needs vLLM (its
CPU build here: scripts/test_vllm.sh). The toy task is tests/workers/grpo_worker.py's: the share of completion tokens
from the lower half of the vocabulary. TRL logs `sampling/sampling_logp_difference`, how far vLLM's log-probs of the
sampled tokens are from the trainer's: small only when vLLM holds the weights the trainer has.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from datasets import Dataset

STEPS = 5


def reward_low_half(completions: list[str], **kwargs: Any) -> list[float]:
    """Share of the completion's tokens from t3..t47."""

    def low(word: str) -> bool:
        return word.startswith("t") and word[1:].isdigit() and int(word[1:]) < 48

    return [sum(low(w) for w in c.split()) / max(len(c.split()), 1) for c in completions]


def cpu_reload_adapter(generation: Any) -> None:
    """On vLLM's CPU build: write weights through `reload_weights`, all of one sync at once. Tests only.

    vLLM's CPU backend prepacks each linear weight and drops the Parameter that `load_weights` writes into ("'Parameter'
    object has no attribute 'weight_loader'"); its `reload_weights` reloads in place. Reloaded one tensor at a time
    (plain TRL's loads), vLLM's log-probs were 0.08 from the trainer's at the first step; reloaded together, 5e-4. So
    loads are kept (copied: ours are views of a gathered unit) and reloaded when the sync resets the prefix cache.
    On a GPU, vLLM does not prepack and none of this is needed.
    """
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    load, reset = runner.model.load_weights, generation.llm.reset_prefix_cache
    pending: list = []
    reloading: list = []

    def keep(weights: Any) -> None:
        if reloading:  # reload_weights calls the model's load_weights itself
            return load(weights)
        pending.extend((name, tensor.detach().clone()) for name, tensor in weights)

    def reload_then_reset() -> Any:
        if pending:
            reloading.append(True)
            try:
                runner.reload_weights(weights_iterator=iter(list(pending)))
            finally:
                reloading.clear()
                pending.clear()
        return reset()

    runner.model.load_weights = keep
    generation.llm.reset_prefix_cache = reload_then_reset


def trainer(mode: str, out: str, model: str, name: str, **overrides: Any) -> Any:
    """A GRPO trainer generating with vLLM in colocate mode, fp32, the same seed and global batch in every run."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from tests.tiny_models import tiny_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    peft_config = overrides.pop("peft_config", None)
    args = GRPOConfig(
        output_dir=os.path.join(out, name), per_device_train_batch_size=8 // world, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, bf16=False, gradient_checkpointing=False,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, **overrides,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": [f"t{5 + i % 40} t{6 + i % 40}" for i in range(512)]})
    common = dict(model=model, reward_funcs=reward_low_half, train_dataset=prompts, processing_class=tiny_tokenizer())
    common |= {"peft_config": peft_config} if peft_config is not None else {}
    if mode == "plain":
        run = GRPOTrainer(args=args, **common)
    else:
        from hf_fsdp2 import FSDP2Config
        from hf_fsdp2.trl import FSDP2GRPOTrainer

        fsdp2 = FSDP2Config(consolidate_on_train_end=False, checkpoint_on_signals=[])
        run = FSDP2GRPOTrainer(args=args, fsdp2_config=fsdp2, **common)
    if not torch.cuda.is_available():
        cpu_reload_adapter(run.vllm_generation)
    return run


def logged(run: Any) -> dict[str, list[float]]:
    """What each step logged: the reward and how far vLLM's log-probs were from the trainer's."""
    history = [h for h in run.state.log_history if "reward" in h]
    return {
        "rewards": [h["reward"] for h in history],
        "gap_mean": [h["sampling/sampling_logp_difference/mean"] for h in history],
        "gap_max": [h["sampling/sampling_logp_difference/max"] for h in history],
    }


def scenarios(mode: str, out: str, model: str) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each scenario trains a fresh trainer and returns what it logged."""
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])

    def full() -> dict[str, Any]:
        run = trainer(mode, out, model, "full")
        run.train()
        return logged(run)

    def lora_run() -> dict[str, Any]:
        run = trainer(mode, out, model, "lora", peft_config=lora)
        run.train()
        return logged(run)

    def no_sync() -> dict[str, Any]:
        """The negative control: vLLM keeps the first weights."""
        run = trainer(mode, out, model, "no_sync")
        run.vllm_generation.sync_weights = lambda: None
        run.train()
        return logged(run)

    def sleep_mode() -> dict[str, Any]:
        try:
            trainer(mode, out, model, "sleep", vllm_enable_sleep_mode=True)
        except ValueError as error:
            return {"refused": str(error)}
        return {"refused": None}

    return {"full": full, "lora": lora_run, "no_sync": no_sync, "sleep_mode": sleep_mode}


def main() -> None:
    mode, out, model, *chosen = sys.argv[1:]
    import torch.distributed as dist

    results = {}
    for name, scenario in scenarios(mode, out, model).items():
        if name not in chosen:
            continue
        try:
            results[name] = scenario()
        except Exception as error:  # noqa: BLE001 - recorded; the test names it
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(out, f"{mode}-{world}.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"worker done: {sorted(results)}", flush=True)


if __name__ == "__main__":
    main()
