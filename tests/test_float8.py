"""FSDP2Config(float8=True): FP8 training with torchao's float8 (issue 63). Refused by name where it cannot run (the
CPU, GPUs without FP8 tensor cores, an NF4 base, cpu_offload, a PEFT model, compute other than bf16); which layers it
converts (the head never, whatever its name); and on the CPU, with torchao's emulated FP8 matmuls, the whole path a
GPU takes at 1 and 2 ranks (tests/workers/float8_worker.py): converted before sharding, weights loaded into the FP8
all-gather's shards, scales from the whole weight, trained within FP8's tolerance of bf16, checkpointed, resumed,
exported under the original names. The GPU's speed is measured by the GPU check's part fp8."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.sharding import float8
from tests.launch import load_runs, run

# Llama-3.2-3B's shape (what the GPU check's part fp8 trains), built on the meta device: no memory.
SHAPE_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=24)
SHAPE_3B |= dict(num_key_value_heads=8, vocab_size=128256)
# The tiny model of the emulated runs: its MLP's gate and up projections (64 -> 1088) are large enough for torchao's
# tensorwise filter (more than 1024 outputs); everything else stays bf16.
TINY = dict(hidden_size=64, intermediate_size=1088, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY |= dict(vocab_size=256, tie_word_embeddings=True)
# FP8 (e4m3: 3 mantissa bits) against bf16 over the worker's 4 steps, measured 2026-11-28: 1.5e-3 at most (losses
# about 5.55; gate and up projections in FP8). Twice that, and a run that did not compute in FP8 differs by far less.
FP8_VS_BF16 = 3e-3
# 2 ranks against one process with the 2 ranks' micro-batches (gradient accumulation), both in FP8: weights cast with
# one scale from the whole weight's amax (one all-reduce), activations and gradients each from the rows they hold.
# Measured 2026-11-28: equal losses (bf16's same pair: 1.5e-5 apart).
TWO_RANKS_VS_ONE = 1e-5


def test_refused_on_the_cpu_by_name():
    with pytest.raises(ValueError, match=r"FP8 tensor cores \(compute capability 8.9 or newer.*runs on cpu"):
        float8.check_float8_machine(torch.device("cpu"))


def test_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB has compute capability 8\.0"):
        float8.check_float8_machine(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    float8.check_float8_machine(torch.device("cuda", 0))  # an H100 or H200: no error


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(base_quantization="nf4"), "float8=True with base_quantization='nf4'"),
        (dict(cpu_offload=True), "float8=True with cpu_offload=True is not supported"),
    ],
)
def test_config_refuses_what_cannot_combine(fields, message):
    with pytest.raises(ValueError, match=message):
        FSDP2Config(float8=True, **fields)


def test_refuses_peft_models_nf4_bases_and_compute_other_than_bf16():
    from peft import LoraConfig, get_peft_model

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="an NF4 base"):
        float8.check_float8_model(model, is_peft=False, nf4=True, policy=bf16)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="is a PEFT model"):
        float8.check_float8_model(peft, is_peft=True, nf4=False, policy=bf16)
    with pytest.raises(ValueError, match=r"Set TrainingArguments\(bf16=True\)"):
        float8.check_float8_model(model, is_peft=False, nf4=False, policy=MixedPrecisionPolicy())


@pytest.mark.parametrize("tied", [True, False])
def test_converts_every_block_linear_torchao_takes_and_never_the_head(tied):
    """At Llama-3.2-3B's shape: every block's q, o, gate, up and down projections; not k and v (3072 -> 1024: torchao's
    tensorwise filter finds FP8 slower there), not the head (3072 -> 128256, which the size filter alone would take),
    tied or not."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE_3B, tie_word_embeddings=tied))
    expected = [
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj")
    ]
    assert sorted(float8.float8_layers(model)) == expected


def test_a_model_with_no_layer_large_enough_is_refused():
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="no Linear layer of LlamaForCausalLM is large enough"):
        float8.convert_float8(model, False, False, MixedPrecisionPolicy(param_dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("float8")
    torch.manual_seed(0)
    model = os.path.join(out, "model")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(model)
    run("float8_worker.py", 0, str(out), model, timeout=600)
    run("float8_worker.py", 2, str(out), model, timeout=600)
    found = load_runs(out, "float8-1", "float8-2")
    for world, results in found.items():
        for scenario, result in results.items():
            assert "error" not in result, f"{world} {scenario}: {result.get('traceback')}"
    return found


@pytest.mark.parametrize("world", ["float8-1", "float8-2"])
def test_a_user_on_the_cpu_is_refused_by_name(runs, world):
    assert "FP8 tensor cores" in runs[world]["refused"]["refused"]


@pytest.mark.parametrize("world", ["float8-1", "float8-2"])
def test_emulated_fp8_trains_within_tolerance_of_bf16(runs, world):
    result, bf16 = runs[world]["float8"], runs[world]["bf16"]
    assert result["layers"] == [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up")]
    assert result["local_tensor"] == "WeightWithDynamicFloat8CastTensor"  # FSDP2 gathers the FP8 casts
    diff = max(abs(a - b) for a, b in zip(result["losses"], bf16["losses"], strict=True))
    assert 0 < diff <= FP8_VS_BF16, (result["losses"], bf16["losses"])


@pytest.mark.parametrize("world", ["float8-1", "float8-2"])
def test_scales_come_from_the_whole_weight_in_training_and_are_cleared_without_gradients(runs, world):
    result = runs[world]["float8"]
    assert result["scale"] == pytest.approx(result["expected_scale"], rel=1e-6)
    assert result["scales_after_no_grad"] == [None] * len(result["layers"])


def test_two_ranks_train_as_one_process_with_their_micro_batches(runs):
    one, two = runs["float8-1"]["accumulated"]["float8"], runs["float8-2"]["float8"]["losses"]
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= TWO_RANKS_VS_ONE


@pytest.mark.parametrize("world", ["float8-1", "float8-2"])
def test_checkpoint_resume_and_export_keep_the_original_names(runs, world):
    result = runs[world]["float8"]
    assert result["exported"] == result["original"]
    # steps 1-2 restored from the checkpoint's log, 3-4 trained after the resume: the uninterrupted run's
    assert runs[world]["resumed"]["losses"] == pytest.approx(result["losses"], abs=1e-6)
