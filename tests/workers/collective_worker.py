"""What users do with the trained model object: `save_pretrained` and `generate`, on every rank or on rank 0 only.

Usage: collective_worker.py MODEL OUT MODE, MODE one of
- every: train (full, then LoRA); on every rank `trainer.model.save_pretrained(OUT/<kind>/pretrained)` and
  `trainer.save_model(OUT/<kind>/save_model)`; rank 0 writes OUT/every.json when both succeeded;
- rank0_save / rank0_generate: train, then only rank 0 calls save_pretrained / generate (the join bound is
  cut to 5 s here); rank 0 writes OUT/MODE.json with the error and the seconds it took. Rank 1 stays away
  from collectives meanwhile, then both leave at once (the failed check leaves the group unusable).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Trainer, from_pretrained
from hf_fsdp2.sharding import collective_methods
from tests.workers.train_worker import make_dataset

MODEL, OUT, MODE = sys.argv[1:4]
collective_methods.JOIN_TIMEOUT_S = 5


def trained(kind: str) -> FSDP2Trainer:
    model = from_pretrained(MODEL)
    if kind == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(
        os.path.join(OUT, kind, "run"), max_steps=2, per_device_train_batch_size=2, report_to=[], save_strategy="no"
    )
    trainer = FSDP2Trainer(model, args, train_dataset=make_dataset(16, 96))
    trainer.train()
    return trainer


def every_rank() -> None:
    for kind in ("full", "lora"):
        trainer = trained(kind)
        trainer.model.save_pretrained(os.path.join(OUT, kind, "pretrained"))
        trainer.save_model(os.path.join(OUT, kind, "save_model"))
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "every.json"), "w") as f:
            json.dump("ok", f)


def rank0_only() -> None:
    trainer = trained("full")
    if dist.get_rank() != 0:
        time.sleep(collective_methods.JOIN_TIMEOUT_S + 2)
        os._exit(0)
    started = time.monotonic()
    try:
        if MODE == "rank0_save":
            trainer.model.save_pretrained(os.path.join(OUT, "rank0"))
        else:
            trainer.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
        error = None
    except RuntimeError as caught:
        error = str(caught)
    with open(os.path.join(OUT, f"{MODE}.json"), "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - started}, f)
    os._exit(0)


if __name__ == "__main__":
    every_rank() if MODE == "every" else rank0_only()
