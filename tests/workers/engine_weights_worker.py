"""What an inference engine (vLLM) gets from the sharded model after a step (tests/test_engine_weights.py).

Usage: engine_weights_worker.py OUT NF4_MODEL. Rank 0 writes OUT/world{N}.json (per case: names, differences from the
unsharded model, buckets). NF4_MODEL: a saved Llama whose projections NF4 can quantize (rows of 64).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hf_fsdp2 import FSDP2Config, prepare_model
from hf_fsdp2.export.engine_weights import named_full_weights, unit_buckets
from tests.tiny_models import llama

OUT, NF4_MODEL = sys.argv[1:3]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CONFIG = FSDP2Config(consolidate_on_train_end=False)


def lora_model(base: nn.Module | None = None) -> nn.Module:
    """A Llama with LoRA on q and v; on a model with weights, B is not zero, so merging changes the weights."""
    torch.manual_seed(0)
    base = llama() if base is None else base
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if base.device.type == "meta":
        return model  # a skeleton: its adapters are initialised when it is loaded (B = 0)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model


def compare(sharded: nn.Module, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Names the engine gets, the largest difference from `expected`, and how many buckets (gathers) it took."""
    got = {name: tensor.detach().clone() for name, tensor in named_full_weights(sharded)}
    common = sorted(set(got) & set(expected))
    diff = max(float((got[n].float() - expected[n].float()).abs().max()) for n in common)
    return {
        "names": sorted(got),
        "expected_names": sorted(expected),
        "max_diff": diff,
        "dtypes": sorted({str(t.dtype) for t in got.values()}),
        "buckets": sum(1 for _ in unit_buckets(sharded)),
        "units": sum(isinstance(m, FSDPModule) for m in sharded.modules()),
    }


def full() -> dict[str, Any]:
    """A tied Llama: every parameter whole, the tied head once (as vLLM wants it), no buffers."""
    torch.manual_seed(0)
    model = llama(tied=True)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    return compare(prepare_model(model, CONFIG), expected)


def bf16() -> dict[str, Any]:
    """Mixed precision: the weights in the compute dtype, each the fp32 master rounded once."""
    torch.manual_seed(0)
    model = llama()
    expected = {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}
    return compare(prepare_model(model, CONFIG, bf16=True), expected)


def lora() -> dict[str, Any]:
    """LoRA merged into copies of the base weights, under the base model's names, as peft's merge_and_unload."""
    model = lora_model()
    merged = copy.deepcopy(model).merge_and_unload()
    expected = {name: p.detach().clone() for name, p in merged.named_parameters()}
    sharded = prepare_model(model, CONFIG)
    result = compare(sharded, expected)
    # The live weights are untouched: a second pass hands out the same values.
    again = dict(named_full_weights(sharded))
    result["second_pass_diff"] = max(float((again[n] - expected[n]).abs().max()) for n in expected)
    return result


def nf4() -> dict[str, Any]:
    """QLoRA: the NF4 base dequantised (B = 0, so merging adds nothing): torchao's whole-tensor NF4, dequantised."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        return {"skipped": "torchao (the qlora extra) is not installed"}
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp2 import from_pretrained

    reference = lora_model(AutoModelForCausalLM.from_pretrained(NF4_MODEL))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.zero_()
        for name, module in reference.named_modules():  # every frozen projection of the blocks is NF4
            if isinstance(module, nn.Linear) and ".layers." in name and "lora_" not in name:
                module.weight.copy_(to_nf4(module.weight.detach()).get_original_weight())
    expected = {name: p.detach().clone() for name, p in reference.merge_and_unload().named_parameters()}
    nf4_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    sharded = prepare_model(lora_model(from_pretrained(NF4_MODEL, quantization_config=nf4_config)), CONFIG)
    return compare(sharded, expected)


CASES: dict[str, Callable[[], dict[str, Any]]] = {"full": full, "bf16": bf16, "lora": lora, "nf4": nf4}


def main() -> None:
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case()
        except Exception as error:  # noqa: BLE001 - reported per case
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, f"world{WORLD}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
