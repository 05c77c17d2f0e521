"""PEFT methods beyond LoRA, each trained as a user's script would: plain `Trainer` on a real base in one process,
or `FSDP2Trainer` over peft on hf_fsdp2's meta skeleton (`skeleton`) or on a real base on every rank (`object`).

Usage: peft_methods_worker.py {plain,fsdp2} OUT MODEL [SCENARIO ...], a scenario being `LOAD/METHOD` (LOAD: plain,
skeleton or object). All run in one launch (one process group); rank 0 writes OUT/MODE-WORLD.json: scenario ->
losses, trainable weights and probe logits (or an error); each run's output_dir is OUT/MODE-WORLD/LOAD/METHOD
(checkpoint-4 and the end-of-training export: peft's adapter folder).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from peft import (
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    PeftConfig,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
    VeraConfig,
    get_peft_model,
)
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, set_seed

from tests.workers.scenarios import PARITY_ADAM_EPSILON, full_weights, losses, run_scenarios
from tests.workers.train_worker import make_dataset

MODE, OUT, MODEL = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH, GRAD_ACCUM, STEPS, SEED = 4, 2, 4, 42
PROBE = [[5, 9, 13, 17, 21, 25, 29, 33]]
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")

# One config per method, as peft's docs write them (dropout 0: masks are drawn per rank).
METHODS: dict[str, Callable[[], PeftConfig]] = {
    "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "prefix_tuning": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "p_tuning": lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"),
    "dora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    "rslora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "all_linear": lambda: LoraConfig(r=4, target_modules="all-linear"),
    "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "loha": lambda: LoHaConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "lokr": lambda: LoKrConfig(r=4, target_modules=["q_proj", "v_proj"]),
    # Five embedding rows trained (3 and 2 per rank at 2 ranks), started from the base rows.
    "trainable_tokens": lambda: LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7, 40, 90]),
}


def build(load: str, method: str) -> Any:
    """The PEFT model: peft over a real base (plain, object) or over hf_fsdp2's meta skeleton."""
    set_seed(SEED)  # seeded first, as a single-process script: the adapters draw from this state
    if load == "skeleton":
        from hf_fsdp2 import from_pretrained

        base = from_pretrained(MODEL, AutoModelForCausalLM)
    else:
        base = AutoModelForCausalLM.from_pretrained(MODEL)
    return get_peft_model(base, METHODS[method]())


def trainer_for(load: str, method: str) -> Trainer:
    """Plain Trainer or FSDP2Trainer over the same global batch, with checkpoint-4 and the end-of-run export."""
    per_device = GLOBAL_BATCH // (WORLD * GRAD_ACCUM)
    args = TrainingArguments(
        output_dir=os.path.join(RUN_DIR, load, method),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=GRAD_ACCUM,
        max_steps=STEPS,
        learning_rate=1e-2,
        adam_epsilon=PARITY_ADAM_EPSILON,  # runs are compared element-wise across world sizes: see its definition
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=STEPS,
        report_to=[],
        seed=SEED,
        use_cpu=True,
        disable_tqdm=True,
    )
    model = build(load, method)
    data = make_dataset(64, 96)
    if MODE == "plain":
        trainer = Trainer(model, args, train_dataset=data)
    else:
        from hf_fsdp2 import FSDP2Trainer

        trainer = FSDP2Trainer(model, args, train_dataset=data)
    return trainer


def scenario(load: str, method: str) -> Callable[[], dict[str, Any]]:
    """Train `method`, export it (plain: peft's save_pretrained), and record what the tests compare."""

    def run() -> dict[str, Any]:
        trainer = trainer_for(load, method)
        trainer.train()
        if MODE == "plain":
            trainer.model.save_pretrained(trainer.args.output_dir)
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor(PROBE)).logits
        return {
            "losses": losses(trainer),
            "trainable": full_weights(trainer.model, trainable_only=True),
            "logits": logits.float().tolist(),
        }

    return run


def main() -> None:
    loads = ["plain"] if MODE == "plain" else ["skeleton", "object"]
    scenarios = {f"{load}/{method}": scenario(load, method) for load in loads for method in METHODS}
    run_scenarios(scenarios, sys.argv[4:], f"{RUN_DIR}.json")


if __name__ == "__main__":
    main()
