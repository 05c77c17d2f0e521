"""Part "build": the models saved once (random weights, seeded), and the machine described."""

from __future__ import annotations

import os
import time
from importlib.metadata import version
from importlib.util import find_spec

from gpu_parts.common import dry_run, model_path, sizes


def build(spec: dict) -> dict:
    """Save the models the chosen parts train (`spec["models"]`) once (random weights, seeded), and describe the
    machine."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    described = {}
    for name, shape in sizes(dry_run()).items():
        if name not in spec.get("models", ("m100", "m1b")):
            continue
        config = LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv"], tie_word_embeddings=shape["tied"], rope_theta=500000.0,
            max_position_embeddings=131072,
        )  # fmt: skip
        saved = os.path.exists(os.path.join(model_path(name), "config.json"))
        torch.manual_seed(0)
        with torch.device("meta" if saved else device):  # a model saved by an earlier call is only counted
            model = LlamaForCausalLM(config).to(getattr(torch, shape["dtype"]))
        if not saved:
            model.save_pretrained(model_path(name))
        described[name] = {**shape, "params": sum(p.numel() for p in model.parameters())}
        del model
    gpu = torch.cuda.get_device_properties(0) if device == "cuda" else None
    environment = {
        "device_name": gpu.name if gpu else "cpu (dry run)" if dry_run() else "cpu",
        "device_memory_mib": round(gpu.total_memory / 2**20) if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": version("accelerate"),
        "torchao": version("torchao") if find_spec("torchao") else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if gpu else None,
        "attention": "sdpa",
        "models": described,
        "date": time.strftime("%Y-%m-%d"),
    }
    return {"environment": environment}
