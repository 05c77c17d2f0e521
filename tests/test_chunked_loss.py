"""The LM head and cross entropy over chunks of tokens (FSDP2Config(loss_chunk_size)) against transformers'
ForCausalLMLoss on the full logits: the same loss and gradients (summation order aside), and which models it
refuses. The 2-rank training run with it is in tests/test_parity.py (variant --loss-chunk)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_fsdp2.long_rows.chunked_loss import chunked_causal_lm_loss, chunked_loss, why_not_chunked


def _inputs(bias: bool) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the head's initial weights
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    head = nn.Linear(16, 50, bias=bias)
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = -100  # a prompt
    labels[2] = -100  # a row with nothing to predict
    return hidden, head, labels


@pytest.mark.parametrize("num_items", [None, 13])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 33, 1000])
def test_chunked_loss_and_gradients_equal_the_full_logits_loss(num_items, bias, chunk):
    hidden, head, labels = _inputs(bias)
    full = ForCausalLMLoss(head(hidden), labels, 50, num_items_in_batch=num_items)
    expected = torch.autograd.grad(full, [hidden, *head.parameters()])
    ours = chunked_causal_lm_loss(hidden, head, labels, chunk, num_items_in_batch=num_items)
    got = torch.autograd.grad(ours, [hidden, *head.parameters()])
    assert abs(ours.item() - full.item()) <= 1e-6 * max(1.0, abs(full.item()))  # fp32 rounding of a ~10 sum
    for a, b in zip(got, expected, strict=True):
        assert (a - b).abs().max().item() <= 1e-6


def test_the_model_forward_runs_with_its_head_passing_hidden_states_and_is_restored(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny("llama"))
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    full = model(input_ids=ids, labels=ids)
    with chunked_loss(model, 4):
        chunked = model(input_ids=ids, labels=ids)
    assert chunked.logits.shape[-1] == model.config.hidden_size  # the head handed hidden states through
    assert abs(chunked.loss.item() - full.loss.item()) <= 1e-6
    again = model(input_ids=ids, labels=ids)
    assert again.logits.shape[-1] == model.config.vocab_size and again.loss.item() == full.loss.item()
    assert "forward" not in vars(model.get_output_embeddings()) and "_loss_function" not in vars(model)


def test_models_whose_logits_change_before_the_loss_are_named():
    import transformers

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    reasons = {}
    for family in ("Llama", "Qwen2", "Mistral", "Gemma2", "Cohere", "Granite"):
        config = getattr(transformers, f"{family}Config")(**small, head_dim=8)
        with torch.device("meta"):
            model = getattr(transformers, f"{family}ForCausalLM")(config)
        reasons[family] = why_not_chunked(model)
    assert reasons["Llama"] is reasons["Qwen2"] is reasons["Mistral"] is None
    for family in ("Gemma2", "Cohere", "Granite"):  # soft-capping, logit_scale, logits_scaling
        assert "changes the logits between the head and the loss" in reasons[family], family


def test_a_bad_chunk_size_is_refused():
    from hf_fsdp2 import FSDP2Config

    with pytest.raises(ValueError, match="loss_chunk_size=0 must be an int >= 1"):
        FSDP2Config(loss_chunk_size=0)


@pytest.mark.parametrize(
    "family", ["llava", "qwen2_vl", "qwen2_5_vl", "gemma3", "smolvlm", "gpt2", "qwen3_moe", "mixtral"]
)
def test_other_families_chunk_their_loss_exactly(family):
    """Vision-language models (rows with and without an image), GPT-2 and MoE models (router loss included)."""
    from tests.tiny_models import BUILDERS
    from tests.tiny_vlms import FAMILIES

    torch.manual_seed(0)
    if family in FAMILIES:
        model = FAMILIES[family].build()
        batch = FAMILIES[family].collate([FAMILIES[family].row(0, True), FAMILIES[family].row(1, False)])
    else:
        model = BUILDERS[family]()
        ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids}
    assert why_not_chunked(model) is None
    full = model(**batch)
    with chunked_loss(model, 5):
        chunked = model(**batch)
    assert chunked.logits.shape[-1] != full.logits.shape[-1]  # the chunked path ran: no full logits
    assert abs(chunked.loss.item() - full.loss.item()) <= 1e-6


def test_a_trainer_that_computes_its_own_loss_is_not_chunked():
    """Its compute_loss may read outputs.logits: a subclass of FSDP2Trainer, or a trainer FSDP2Mixin mixes into."""
    from transformers import Trainer

    from hf_fsdp2 import FSDP2Mixin, FSDP2Trainer
    from hf_fsdp2.trainer.step import _own_compute_loss

    class Metrics(FSDP2Trainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    class OwnLoss(Trainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    class Mixed(FSDP2Mixin, OwnLoss):
        pass

    assert not _own_compute_loss(object.__new__(FSDP2Trainer))
    assert _own_compute_loss(object.__new__(Metrics)) and _own_compute_loss(object.__new__(Mixed))
