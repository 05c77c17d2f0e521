"""Tiny Hugging Face models built from configs and saved locally: nothing is downloaded."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96
# The decoder shape every tiny causal LM here shares (GQA: 4 query heads, 2 key/value heads).
TEXT_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)


def llama(tied: bool = False, layers: int = 2) -> PreTrainedModel:
    """A Llama with GQA and RoPE; `tied` shares embedding and head."""
    return LlamaForCausalLM(LlamaConfig(**{**TEXT_SHAPE, "num_hidden_layers": layers}, tie_word_embeddings=tied))


def llama_reward() -> PreTrainedModel:
    """A Llama sequence classifier with one output: a reward model checkpoint (TRL's RewardTrainer)."""
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(**TEXT_SHAPE, num_labels=1))


def qwen2() -> PreTrainedModel:
    """A Qwen2 (attention biases, untied)."""
    return Qwen2ForCausalLM(Qwen2Config(**TEXT_SHAPE, tie_word_embeddings=False))


def gpt2() -> PreTrainedModel:
    """A GPT-2 (tied head, Conv1D layers, learned positions), without dropout."""
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # Dropout masks are drawn per rank, so runs with dropout cannot match across world sizes.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def moe(family: str) -> PreTrainedModel:
    """A mixture-of-experts LM (4 experts, top-2) whose loss includes the router's auxiliary loss."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(**TEXT_SHAPE, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
    if family == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=4, moe_intermediate_size=16, head_dim=8))
    return MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4))


def sequence_parallel_family(family: str) -> PreTrainedModel:
    """The families sequence parallelism runs, with an 8-token sliding window where the family has one."""
    import transformers

    extra = {
        "mistral": dict(sliding_window=8),
        "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 1 slides
        "qwen3": dict(head_dim=8),
        "gemma": dict(head_dim=8),
        # Gemma 3: a sliding layer then a global one, q/k norms, its own attention scaling.
        "gemma3_text": dict(head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    }[family]
    config_class, model_class = {
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    }[family]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**TEXT_SHAPE, **extra))


BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": llama,
    "llama_tied": lambda: llama(tied=True),
    "llama_reward": llama_reward,
    "qwen2": qwen2,
    "gpt2": gpt2,
    "qwen3_moe": lambda: moe("qwen3_moe"),
    "mixtral": lambda: moe("mixtral"),
    "llama_bf16": lambda: llama().to(torch.bfloat16),
    "mistral_window": lambda: sequence_parallel_family("mistral"),
    "qwen2_window": lambda: sequence_parallel_family("qwen2"),
    "qwen3": lambda: sequence_parallel_family("qwen3"),
    "gemma": lambda: sequence_parallel_family("gemma"),
    "gemma3_text": lambda: sequence_parallel_family("gemma3_text"),
}


def save_tiny(name: str, directory: str, seed: int = 1234, safe_serialization: bool = True) -> str:
    """Build model `name` with a fixed seed and save it under `directory/name`; return the folder."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    path = os.path.join(directory, name if safe_serialization else f"{name}_bin")
    if safe_serialization:
        model.save_pretrained(path)
    else:
        model.config.save_pretrained(path)
        state = {k: v for k, v in model.state_dict().items() if not (name.endswith("tied") and k == "lm_head.weight")}
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
    return path


def tiny_tokenizer():
    """A word-level fast tokenizer over the tiny vocabulary, built locally (tokens 't0'..'t95')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def save_tiny_sentence_transformer(directory: str, seed: int = 1234) -> str:
    """A sentence-transformers model (tiny BERT without dropout + mean pooling) saved under `directory`; no download."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    bert = os.path.join(directory, "tiny_bert")
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        # Dropout masks are drawn per rank, so runs with dropout cannot match across world sizes.
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(bert)
    tiny_tokenizer().save_pretrained(bert)
    model = SentenceTransformer(modules=[Transformer(bert, max_seq_length=32), Pooling(32, "mean")], device="cpu")
    path = os.path.join(directory, "tiny_sentence_transformer")
    model.save_pretrained(path)
    return path
