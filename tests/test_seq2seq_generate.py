"""Seq2SeqTrainer(predict_with_generate=True) through FSDP2Mixin at 2 ranks on a T5 given as a path: it trains, and
the tokens it predicts (generate on the sharded model, gathered once per call) are those its exported folder
generates unsharded (tests/workers/seq2seq_worker.py)."""

from __future__ import annotations

import json
import os

import torch

from tests.launch import run


def _until_eos(tokens: list[int]) -> list[int]:
    """Generated tokens up to and including the first EOS (2), without the start token and padding."""
    body = [t for t in tokens[1:] if t != -100]
    if 2 in body:
        return body[: body.index(2) + 1]
    while body and body[-1] == 0:  # padding after a sequence that hit the length limit
        body.pop()
    return body


def test_predict_with_generate_on_the_sharded_model_gives_the_unsharded_tokens(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=2, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    run("seq2seq_worker.py", 2, str(tmp_path / "t5"), str(tmp_path / "out"), timeout=600)
    with open(os.path.join(tmp_path, "out", "result.json")) as f:
        result = json.load(f)
    assert result["losses"][-1] < 0.5 * result["losses"][0]  # it learned
    predicted = [_until_eos(p) for p in result["predictions"]]
    assert predicted == [_until_eos(e) for e in result["expected"]]
    assert sum(len(p) > 2 for p in predicted) >= 4  # real sequences, not an immediate EOS
