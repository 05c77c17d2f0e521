"""Prompt/response batches: loss only on the response, and packing that keeps examples apart."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_fsdp2.jobs.sft_data import IGNORE_INDEX, prepare_for_packing, sft_collator, tokenize_pairs
from tests.tiny_models import tiny_tokenizer

ROWS = {"prompt": ["t5 t6", "t7 t8 t9", "t10"], "response": ["t11 t12", "t13", "t14 t15 t16"]}


def test_labels_cover_only_the_response_and_its_eos():
    tokenizer = tiny_tokenizer()
    rows = tokenize_pairs(Dataset.from_dict(ROWS), tokenizer, max_length=32)
    first = rows[0]
    prompt_length = len(tokenizer("t5 t6")["input_ids"])
    assert first["labels"][:prompt_length] == [IGNORE_INDEX] * prompt_length
    assert first["labels"][prompt_length:] == [11, 12, tokenizer.eos_token_id]


def test_packed_examples_see_only_themselves(tiny):
    tokenizer = tiny_tokenizer()
    rows = tokenize_pairs(Dataset.from_dict(ROWS), tokenizer, max_length=32)
    features = [{k: rows[i][k] for k in ("input_ids", "labels")} for i in range(3)]
    packed = sft_collator(tokenizer, packing=True)(features)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"))  # training mode: what packing is for
    prepare_for_packing(model)
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
        start = len(features[0]["input_ids"])
        alone = model(input_ids=torch.tensor([features[1]["input_ids"]])).logits[0]
    assert torch.allclose(logits[start : start + len(alone)], alone, atol=1e-5)
