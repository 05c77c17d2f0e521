"""The embedded defaults, built deterministically on this machine (nothing comes from a hub):

- causal LM: a tiny Llama, its tokenizer and a synthetic instruction task, `sort : 3 1 4 1 =` → `1 1 3 4`
  and `reverse : 3 1 4 1 =` → `1 4 1 3`. An untrained model scores 0 exact match; a few hundred steps on
  2 CPU cores take it well above 0.5.
- classification: short sentiment sentences for a pretrained encoder; the eval set uses adjectives that
  never occur in training, so only pretrained word knowledge can score above chance on it.
"""

from __future__ import annotations

import json
import os
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

OPERATIONS = ("sort", "reverse")
DIGITS = tuple(str(d) for d in range(10))
VOCAB = ("<pad>", "<s>", "</s>", *OPERATIONS, ":", "=", *DIGITS)
EXACT_MATCH_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "exact_match.py")
ACCURACY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "accuracy.py")
# Sentiment words: the first part of each list trains, the rest (unseen in training) evaluates.
POSITIVE = (
    "good",
    "great",
    "wonderful",
    "excellent",
    "delightful",
    "superb",
    "lovely",
    "brilliant",
    "fantastic",
    "charming",
    "marvelous",
    "splendid",
    "terrific",
    "enjoyable",
    "beautiful",
    "pleasant",
)
NEGATIVE = (
    "bad",
    "awful",
    "terrible",
    "horrible",
    "dreadful",
    "boring",
    "dull",
    "poor",
    "disappointing",
    "painful",
    "miserable",
    "tedious",
    "mediocre",
    "unpleasant",
    "ugly",
    "annoying",
)
SUBJECTS = (
    "the film",
    "this movie",
    "the plot",
    "the acting",
    "the ending",
    "the soundtrack",
    "the story",
    "this book",
    "the dinner",
    "the service",
    "the show",
    "our trip",
)
TEMPLATES = (
    "{s} was {w}.",
    "i thought {s} was {w}.",
    "honestly, {s} was {w}.",
    "{s} is {w} overall.",
    "everyone agreed that {s} was {w}.",
)


def demo_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the task's symbols (whitespace-separated)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


# hidden, intermediate size of each demo model. "qlora": every projection splits into whole NF4 blocks
# (64 x 256 values) at up to 4 ranks, so a 4-bit base quantizes all of them (hf_fsdp2.adapters.nf4.why_not_nf4).
DEMO_SIZES = {"tiny": (64, 128), "qlora": (256, 512)}


def demo_config(size: str = "tiny") -> LlamaConfig:
    """A 2-layer Llama small enough to learn the task in minutes on a CPU."""
    if size not in DEMO_SIZES:
        raise ValueError(f"demo_size={size!r} is not a demo model; choose one of {', '.join(DEMO_SIZES)}.")
    hidden, intermediate = DEMO_SIZES[size]
    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def example(rng: random.Random, length: int = 4) -> dict[str, str]:
    """One prompt/response pair."""
    operation = rng.choice(OPERATIONS)
    digits = [rng.choice(DIGITS) for _ in range(length)]
    answer = sorted(digits) if operation == "sort" else digits[::-1]
    return {"prompt": f"{operation} : {' '.join(digits)} =", "response": " ".join(answer)}


def write_examples(path: str, n: int, seed: int) -> str:
    """Write `n` examples as JSON lines (the same file for the same seed)."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(example(rng)) + "\n")
    return path


def build_demo(
    directory: str, train_examples: int = 4000, eval_examples: int = 200, seed: int = 0, size: str = "tiny"
) -> dict[str, str]:
    """Create (once) the demo model folder and data files under `directory`; return their paths.

    Rank 0 only: call it before starting ranks, or on rank 0 followed by a barrier.
    """
    paths = {
        "model": os.path.join(directory, "model" if size == "tiny" else f"model-{size}"),
        "train": os.path.join(directory, "train.jsonl"),
        "eval": os.path.join(directory, "eval.jsonl"),
    }
    if not os.path.isfile(os.path.join(paths["model"], "model.safetensors")):
        torch.manual_seed(seed)
        LlamaForCausalLM(demo_config(size)).save_pretrained(paths["model"])
        demo_tokenizer().save_pretrained(paths["model"])
    if not os.path.isfile(paths["train"]):
        write_examples(paths["train"], train_examples, seed=seed + 1)
    if not os.path.isfile(paths["eval"]):
        write_examples(paths["eval"], eval_examples, seed=seed + 2)
    return paths


def sentiment_example(rng: random.Random, split: str) -> dict:
    """One sentence with label 1 (positive) or 0 (negative); train and eval use disjoint adjectives."""
    label = rng.randrange(2)
    words = POSITIVE if label else NEGATIVE
    words = words[:10] if split == "train" else words[10:]
    sentence = rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), w=rng.choice(words))
    return {"text": sentence, "label": label}


def build_sentiment(
    directory: str, train_examples: int = 512, eval_examples: int = 128, seed: int = 0
) -> dict[str, str]:
    """Write (once) the sentiment train/eval JSON-lines files under `directory`; return their paths."""
    paths = {
        "train": os.path.join(directory, "sentiment_train.jsonl"),
        "eval": os.path.join(directory, "sentiment_eval.jsonl"),
    }
    for split, n, offset in (("train", train_examples, 1), ("eval", eval_examples, 2)):
        if not os.path.isfile(paths[split]):
            rng = random.Random(seed + offset)
            os.makedirs(directory, exist_ok=True)
            with open(paths[split], "w") as f:
                for _ in range(n):
                    f.write(json.dumps(sentiment_example(rng, split)) + "\n")
    return paths
