"""What sharding a reward model costs per scoring call, against keeping it whole on every rank.

GRPO and RLOO score each step's completions with their reward models, once per step, under torch.inference_mode().
hf_fsdp2 shards a reward model (frozen, its root resharded after each forward): each call then all-gathers it
unit by unit. Kept whole, every rank holds all of it and runs no collective. For two Llama sequence classifiers
(num_labels=1) built from configs, this prints the median time of one scoring call (interleaved, after a warm-up) and
the parameter bytes each rank holds, both ways.

Usage (2 ranks):
    torchrun --nproc_per_node 2 scripts/measure/measure_reward_model.py [--calls 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForSequenceClassification

from hf_fsdp2 import FSDP2Config, prepare_model

SIZES = {"small (4 x 256)": (4, 256), "~100M (12 x 768)": (12, 768)}
BATCH, TOKENS = 8, 64  # completions per rank per step, tokens each


def scorer(layers: int, hidden: int) -> nn.Module:
    """A reward model with seeded weights (the same on every rank)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16000, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForSequenceClassification(config).eval().requires_grad_(False)


def local_bytes(model: nn.Module) -> int:
    """Parameter bytes this rank holds (a DTensor's local shard)."""
    return sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())


def seconds_per_call(model: nn.Module, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        dist.barrier()
        started = time.perf_counter()
        model(input_ids=ids)
        dist.barrier()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ids = torch.randint(1, 16000, (BATCH, TOKENS), generator=torch.Generator().manual_seed(dist.get_rank()))
    rows = []
    for name, (layers, hidden) in SIZES.items():
        whole = scorer(layers, hidden)
        sharded = prepare_model(scorer(layers, hidden), FSDP2Config())
        times: dict[str, list[float]] = {"whole": [], "sharded": []}
        for call in range(args.calls + 1):
            for label, model in (("whole", whole), ("sharded", sharded)):
                elapsed = seconds_per_call(model, ids)
                if call:  # the first call of each is a warm-up
                    times[label].append(elapsed)
        rows.append({
            "model": name, "whole_ms": 1e3 * statistics.median(times["whole"]),
            "sharded_ms": 1e3 * statistics.median(times["sharded"]),
            "whole_mib": local_bytes(whole) / 2**20, "sharded_mib": local_bytes(sharded) / 2**20,
        })  # fmt: skip
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} CPU ranks (gloo), {BATCH} x {TOKENS} tokens per rank per call")
        print("| reward model | whole per rank: ms / MiB | sharded: ms / MiB |\n|---|---:|---:|")
        for r in rows:
            print(
                f"| {r['model']} | {r['whole_ms']:.0f} / {r['whole_mib']:.0f} | "
                f"{r['sharded_ms']:.0f} / {r['sharded_mib']:.0f} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
