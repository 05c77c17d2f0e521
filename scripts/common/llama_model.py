"""The random Llama the benchmark and the measurements load and train: saved once under a path, sized by its layers
and hidden width.

Imported by bare name (`from llama_model import build_model`): a script puts scripts/common on sys.path first.
"""

from __future__ import annotations

import os


def build_model(path: str, layers: int, hidden: int = 768, vocab: int = 16000, tied: bool = False) -> int:
    """Save a Llama (fp32; 12 layers of 768 = ~100M parameters) under `path` once; return its size in bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 64, 1),
        tie_word_embeddings=tied,
    )
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() * p.element_size() for p in model.parameters())
