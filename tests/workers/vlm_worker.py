"""Vision-language models on mixed image/text batches: plain `Trainer` or `FSDP2Trainer`, one scenario each.

Usage: vlm_worker.py {plain,fsdp2} OUT MODELS_DIR [SCENARIO ...]. Rows are read in order (sequential sampler)
and 40% of them hold an image, so at 2 ranks some steps have an image on one rank only and some on none.
Rank 0 writes OUT/{mode}-{world}.json: scenario -> losses, trainable weights, and per step which ranks held
an image.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForImageTextToText, Trainer, TrainingArguments

from tests.tiny_vlms import FAMILIES, VlmFamily
from tests.workers.scenarios import (
    PARITY_ADAM_EPSILON,
    full_weights,
    losses,
    run_scenarios,
    saved_configs,
)

MODE, OUT, MODELS = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH = 2
ROWS = 12
# Rows with an image: at 2 ranks (rows 2k, 2k+1 form step k) steps 0, 2, 4 hold an image on one rank only,
# step 1 on both and steps 3 and 5 on none, after steps that had one (Adam moments then go on without a gradient).
IMAGE_ROWS = {0, 2, 3, 5, 8}

if MODE == "fsdp2":
    from hf_fsdp2 import FSDP2Trainer

    TrainerClass: type[Trainer] = FSDP2Trainer
else:
    TrainerClass = Trainer


def dataset(family: VlmFamily) -> Dataset:
    rows = [family.row(i, i in IMAGE_ROWS) for i in range(ROWS)]
    return Dataset.from_list(rows)


def args(name: str, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = dict(
        output_dir=os.path.join(OUT, f"{MODE}-{WORLD}", name),
        per_device_train_batch_size=GLOBAL_BATCH // WORLD,
        per_device_eval_batch_size=GLOBAL_BATCH // WORLD,
        max_steps=6,
        learning_rate=1e-2,
        adam_epsilon=PARITY_ADAM_EPSILON,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def train(
    name: str, family: VlmFamily, freeze_vision: bool = False, lora: bool = False, lora_targets: Any = None
) -> dict[str, Any]:
    """Train a family's tiny model on mixed batches; return losses, trainable weights, image placement."""
    path = os.path.join(MODELS, family.name)
    if MODE == "fsdp2" and not (freeze_vision or lora):
        model: Any = path  # the path route: a meta skeleton, each rank reads its slices
    else:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        if freeze_vision:
            model.get_encoder("image").requires_grad_(False)
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(0)  # the adapters' initial values: the same in both runs
            # LoRA on the language model only: the vision tower's projections are named alike.
            targets = lora_targets or family.lm_lora_targets
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    seen: list[bool] = []

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seen.append(any(r["has_image"] for r in rows))
        return family.collate(rows)

    trainer = TrainerClass(model=model, args=args(name), train_dataset=dataset(family), data_collator=collate)
    trainer.train()
    extra: dict[str, Any] = {}
    if not (freeze_vision or lora):
        # Evaluation on mixed batches (no gradients: the branches must not desync collectives either) and the
        # export, which from_pretrained must load into the trained weights.
        extra["eval_loss"] = trainer.evaluate(dataset(family))["eval_loss"]
        export = os.path.join(OUT, f"{MODE}-{WORLD}", name, "export")
        trainer.save_model(export)
        reloaded = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
        extra["reloaded"] = full_weights(reloaded)
        extra["architectures"] = saved_configs(export)["config.json"]["architectures"]
    image_steps = [[flag] for flag in seen]
    if WORLD > 1:
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, seen)
        image_steps = [list(step) for step in zip(*gathered, strict=True)]
    return {
        "losses": losses(trainer),
        "weights": full_weights(trainer.model, trainable_only=True),
        "image_steps": image_steps,
        **extra,
    }


def scenarios() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family in FAMILIES.values():
        out[f"{family.name}_full"] = lambda f=family: train(f"{f.name}_full", f)
        out[f"{family.name}_frozen_vision"] = lambda f=family: train(f"{f.name}_frozen", f, freeze_vision=True)
        out[f"{family.name}_lora"] = lambda f=family: train(f"{f.name}_lora", f, lora=True)
        # The naive config: these names match the vision tower's attention too, so adapters train in a branch.
        out[f"{family.name}_lora_everywhere"] = lambda f=family: train(
            f"{f.name}_lora_everywhere", f, lora=True, lora_targets=["q_proj", "v_proj"]
        )
    return out


if __name__ == "__main__":
    run_scenarios(scenarios(), sys.argv[4:], os.path.join(OUT, f"{MODE}-{WORLD}.json"))
