"""TrainingArguments fields no other test sets, each tried with plain `Trainer` or `FSDP2Trainer`.

Usage: arguments_worker.py {plain,fsdp2} OUT LLAMA [SCENARIO ...]; rank 0 writes OUT/{MODE}-{WORLD}.json.
The `refusals` scenario (fsdp2 only) builds a trainer with each refused field set and records the error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, EarlyStoppingCallback, Trainer, TrainingArguments

from tests.workers.scenarios import full_weights, losses, parity_arguments, run_scenarios
from tests.workers.train_worker import make_dataset

MODE, OUT, LLAMA = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
GLOBAL_BATCH = 4
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")

if MODE == "fsdp2":
    from hf_fsdp2 import FSDP2Trainer

    TrainerClass: type[Trainer] = FSDP2Trainer
else:
    TrainerClass = Trainer


def args(name: str, **overrides: Any) -> TrainingArguments:
    """The per-device batch keeps the global batch equal at any world size."""
    return parity_arguments(os.path.join(RUN_DIR, name), GLOBAL_BATCH // WORLD, **overrides)


def train(name: str, **overrides: Any) -> tuple[Trainer, dict[str, Any]]:
    """Train the tiny Llama on rows of varying length with these arguments; its losses and weights."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(LLAMA)
    trainer = TrainerClass(model, args(name, **overrides), train_dataset=make_dataset(32, 96))
    trainer.train()
    return trainer, {"losses": losses(trainer), "weights": full_weights(trainer.model)}


def label_smoothing() -> dict[str, Any]:
    """Trainer's LabelSmoother, normalized by the global token count."""
    return train("label_smoothing", label_smoothing_factor=0.1)[1]


def tokens_seen() -> dict[str, Any]:
    """The count of input tokens, gathered over ranks."""
    trainer, result = train("tokens_seen", include_num_input_tokens_seen="non_padding")
    return {**result, "num_input_tokens_seen": trainer.state.num_input_tokens_seen}


def empty_cache() -> dict[str, Any]:
    """Freeing cached accelerator memory every step changes nothing else."""
    return train("empty_cache", torch_empty_cache_steps=1)[1]


def group_by_length() -> dict[str, Any]:
    """Length-grouped sampling: the same global batches as one process."""
    return train("group_by_length", train_sampling_strategy="group_by_length")[1]


def neftune() -> dict[str, Any]:
    """NEFTune's noise on the input embeddings, drawn on each rank (compared with DDP), and removed after train."""
    trainer, result = train("neftune", neftune_noise_alpha=5.0)
    embeddings = trainer.model.get_input_embeddings()
    return {**result, "hooks_left": len(embeddings._forward_hooks)}


def save_only_model() -> dict[str, Any]:
    """Checkpoints hold the model only: no optimizer or scheduler state."""
    trainer, result = train("save_only_model", save_only_model=True, save_strategy="steps", save_steps=2)
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-2")
    files = sorted(f for f in os.listdir(checkpoint) if not f.startswith("rng_state"))
    return {
        **result,
        "has_optimizer": any(f.startswith("optimizer") for f in files),
        "has_scheduler": "scheduler.pt" in files,
    }


def restore_callback_states() -> dict[str, Any]:
    """EarlyStoppingCallback's patience counter comes back from checkpoint-2 with the flag set, so the resumed run
    ends with the uninterrupted run's counter."""
    overrides = dict(
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="loss",
        greater_is_better=False,  # on random held-out rows the eval loss rises: the counter grows at each evaluation
        load_best_model_at_end=True,
    )
    first, first_counter = train_early_stopping("restore_callback_states", **overrides)
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    _, resumed_counter = train_early_stopping(
        "restore_callback_states", checkpoint, restore_callback_states_from_checkpoint=True, **overrides
    )
    return {"losses": losses(first), "counter": first_counter, "counter_after_resume": resumed_counter}


def train_early_stopping(name: str, resume: str | None = None, **overrides: Any) -> tuple[Trainer, int]:
    """Train with an EarlyStoppingCallback (optionally resuming); the trainer and the callback's final counter."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(LLAMA)
    callback = EarlyStoppingCallback(early_stopping_patience=10)
    trainer = TrainerClass(
        model,
        args(name, **overrides),
        train_dataset=make_dataset(32, 96),
        eval_dataset=make_dataset(8, 96, seed=1),
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=resume)
    # Trainer restores callback states into new objects of the same class: read the one it holds now.
    held = next(c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
    return trainer, held.early_stopping_patience_counter


# A value other than the default for each field FSDP2Trainer refuses (argument_verdicts).
REFUSED_EXAMPLES: dict[str, Any] = {
    "enable_jit_checkpoint": True,
    "deepspeed": {"train_batch_size": GLOBAL_BATCH},
    "parallelism_config": "tp2",
}


def refusals() -> dict[str, Any]:
    """Each refused field at construction: our message, or TrainingArguments' own error where it refuses first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out: dict[str, Any] = {}
    for name, value in REFUSED_EXAMPLES.items():
        if name == "parallelism_config":
            from accelerate.parallelism_config import ParallelismConfig

            value = ParallelismConfig(tp_size=2)
        try:
            training = args(f"refused_{name}", **{name: value})
        except Exception as error:  # TrainingArguments' own check (a library this machine lacks)
            out[name] = {"arguments_error": f"{type(error).__name__}: {error}"}
            continue
        try:
            TrainerClass(LlamaForCausalLM(LlamaConfig(**_TINY)), training, train_dataset=make_dataset(8, 96))
            out[name] = {"accepted": True}
        except ValueError as error:
            out[name] = {"refused": str(error)}
    return out


_TINY = dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)

SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        label_smoothing,
        tokens_seen,
        empty_cache,
        group_by_length,
        neftune,
        save_only_model,
        restore_callback_states,
    )
}
if MODE == "fsdp2":
    SCENARIOS["refusals"] = refusals

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[4:], f"{RUN_DIR}.json")
