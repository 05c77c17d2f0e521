"""Seq2SeqTrainer(predict_with_generate=True) with the mixin, on an encoder-decoder (T5) given as a path.

Usage: seq2seq_worker.py MODEL OUT. Trains a copy-plus-one task, predicts with generate on the sharded model, and
writes OUT/result.json (rank 0): losses, the predictions, and the tokens the exported folder generates unsharded.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments, T5ForConditionalGeneration

from hf_fsdp2 import FSDP2Config, FSDP2Mixin
from tests.tiny_models import tiny_tokenizer


class FSDP2Seq2SeqTrainer(FSDP2Mixin, Seq2SeqTrainer):
    """What a user writes: the mixin before transformers' Seq2SeqTrainer."""


def copy_plus_one(n: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        source = torch.randint(3, 90, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        rows.append({"input_ids": source + [2], "labels": [x + 1 for x in source] + [2]})
    return Dataset.from_list(rows)


def main() -> None:
    model, out = sys.argv[1:3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = Seq2SeqTrainingArguments(
        out, per_device_train_batch_size=8 // world, per_device_eval_batch_size=4 // world, max_steps=60,
        learning_rate=3e-2, predict_with_generate=True, generation_max_length=10, report_to=[], use_cpu=True,
        save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
    )  # fmt: skip
    data = copy_plus_one(32)
    collator = DataCollatorForSeq2Seq(tiny_tokenizer(), label_pad_token_id=-100)
    trainer = FSDP2Seq2SeqTrainer(
        model, args, train_dataset=data, data_collator=collator, fsdp2_config=FSDP2Config(checkpoint_on_signals=[])
    )
    trainer.train()  # the end of training exports OUT (from_pretrained-ready)
    rows = data.select(range(8))
    predictions = trainer.predict(rows).predictions.tolist()
    unsharded = T5ForConditionalGeneration.from_pretrained(out).eval()
    expected = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            expected.append(unsharded.generate(ids, max_length=10, do_sample=False)[0].tolist())
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                       "predictions": predictions, "expected": expected}, f)  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
