"""The full weights an inference engine (vLLM, for GRPO) gets from the sharded model: exact, under the base model's
names, one gather per FSDP unit (tests/workers/engine_weights_worker.py), at 2 ranks and in a world of one."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.docs_blocks import marked_block
from tests.launch import ROOT, run


@pytest.fixture(scope="module", params=[2, 0], ids=["2 ranks", "world of one"])
def sent(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("engine_weights")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out / "nf4_model")  # rows of 64: every projection quantizes
    run("engine_weights_worker.py", request.param, str(out), str(out / "nf4_model"))
    with open(os.path.join(out, f"world{max(request.param, 1)}.json")) as f:
        return json.load(f)


def _ok(case: dict) -> dict:
    assert "error" not in case, case.get("traceback")
    return case


@pytest.mark.parametrize("case", ["full", "bf16", "lora"])
def test_the_engine_gets_the_unsharded_models_weights_exactly(sent, case):
    result = _ok(sent[case])
    assert result["names"] == result["expected_names"]
    assert result["max_diff"] == 0.0


def test_a_tied_head_is_sent_once_and_buffers_not_at_all(sent):
    names = _ok(sent["full"])["names"]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not [name for name in names if "inv_freq" in name or "rotary" in name]


def test_each_unit_is_gathered_once(sent):
    result = _ok(sent["full"])
    assert result["buckets"] == result["units"] == 3  # two decoder layers and the root, not one per tensor


def test_mixed_precision_sends_the_compute_dtype(sent):
    assert _ok(sent["bf16"])["dtypes"] == ["torch.bfloat16"]


def test_lora_is_merged_into_copies_under_the_base_models_names(sent):
    result = _ok(sent["lora"])
    assert not [name for name in result["names"] if "lora_" in name or "base_layer" in name or "base_model" in name]
    assert result["second_pass_diff"] == 0.0  # the live weights were not merged in place


def test_an_nf4_base_is_sent_dequantised(sent):
    result = sent["nf4"]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    _ok(result)
    assert result["names"] == result["expected_names"] and result["max_diff"] == 0.0
    assert result["dtypes"] == ["torch.float32"]


def test_docs_sync_time_table_is_the_committed_measurement():
    """docs/trl.md's sync-time table is rendered from scripts/results/vllm_sync.json: re-render with
    `python scripts/measure/measure_vllm_sync.py --from-json scripts/results/vllm_sync.json`."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "measure"))
    from measure_vllm_sync import render_markdown

    with open(os.path.join(ROOT, "scripts", "results", "vllm_sync.json")) as f:
        rows = json.load(f)["rows"]
    assert marked_block("trl.md", "vllm-sync").strip() == render_markdown(rows).strip()
