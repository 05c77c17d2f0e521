"""Supervised fine-tuning data for causal LMs: prompt/response pairs tokenized with the loss on the
response only, padded per batch. Used by the recipes; nothing here knows about sharding."""

from __future__ import annotations

from typing import Any

from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase

IGNORE_INDEX = -100


def tokenize_pair(
    prompt: str, response: str, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> dict[str, list[int]]:
    """Token ids of prompt + response (+ EOS) with labels masked over the prompt, truncated to max_length."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        response_ids = response_ids + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenize_pairs(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    prompt_column: str = "prompt",
    response_column: str = "response",
) -> Dataset:
    """Tokenize a dataset of prompt/response rows; raise ValueError naming a missing column."""
    for column in (prompt_column, response_column):
        if column not in dataset.column_names:
            raise ValueError(
                f"the dataset has no {column!r} column (columns: {dataset.column_names}); set the prompt/response "
                "column names to the ones your data uses."
            )

    def encode(row: dict[str, Any]) -> dict[str, list[int]]:
        return tokenize_pair(row[prompt_column], row[response_column], tokenizer, max_length)

    tokenized = dataset.map(encode, remove_columns=dataset.column_names, desc="Tokenizing")
    kept = tokenized.filter(lambda row: any(label != IGNORE_INDEX for label in row["labels"]))
    if len(kept) == 0:
        raise ValueError(f"no example keeps a response token within max_length={max_length}; raise max_length.")
    return kept


def sft_collator(tokenizer: PreTrainedTokenizerBase, packing: bool = False) -> Any:
    """Batches for causal-LM fine-tuning.

    padding: inputs padded with the pad token and labels with -100 to the longest sequence in the batch.
    packing: the batch's examples concatenated into one row with position ids restarting at each example,
    no padding at all; attention stays within each example for attention implementations that read
    packed position ids (sdpa and flash attention in transformers 5; tested on Llama with sdpa), and only
    after `prepare_for_packing(model)`.
    """
    if packing:
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token).")
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)


def prepare_for_packing(model: Any) -> None:
    """Turn off the KV cache for training on packed rows.

    NOTE: with `use_cache=True` (most configs' default) transformers 5 builds a cache even in a training
    forward and then skips packed-sequence detection, so packed examples silently attend to each other
    (measured: logits off by 0.18 on a tiny Llama). Generation still uses the cache (generation_config).
    """
    model.config.use_cache = False
