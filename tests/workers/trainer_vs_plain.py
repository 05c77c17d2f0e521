"""One process: plain transformers.Trainer, then FSDP2Trainer (world size 1, no torchrun), same everything.

Writes result.json with both loss curves and the largest weight difference.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_fsdp2 import FSDP2Trainer
from tests.workers.scenarios import PARITY_ADAM_EPSILON
from tests.workers.train_worker import make_dataset


def arguments(out: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        adam_epsilon=PARITY_ADAM_EPSILON,  # the two runs are compared element-wise: see its definition
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
    )


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    model_path, out = sys.argv[1], sys.argv[2]
    plain = Trainer(
        AutoModelForCausalLM.from_pretrained(model_path), arguments(out), train_dataset=make_dataset(64, 96)
    )
    plain.train()
    ours = FSDP2Trainer(model_path, arguments(out), train_dataset=make_dataset(64, 96))
    ours.train()
    full = get_model_state_dict(ours.model, options=StateDictOptions(full_state_dict=True))
    reference = plain.model.state_dict()
    diff = max((full[k] - reference[k]).abs().max().item() for k in full)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"plain": losses(plain), "ours": losses(ours), "max_weight_diff": diff}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
