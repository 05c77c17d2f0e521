"""What the two-stand-in check costs when a LoRA on a meta skeleton gets its initial values.

`hf_fsdp2.adapters.methods` replays peft's `get_peft_model` on a one-element stand-in of the base (the values), and
again from the same RNG state on a varied stand-in (sum(shape) elements per tensor) to find inits computed from the base
weights. This times one replay (what the values alone cost, `adapters.replay_adapters` on the zero stand-in) against
the checked pair (`adapters.check_replayable`) on a Llama skeleton built from a config, LoRA on every linear layer of
the blocks (default init), median of `--repeats`, one process on the CPU. Peak memory is the process's max RSS.

Usage:
    python scripts/measure/measure_adapter_replay.py [--hidden 2048 --layers 16 --rank 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_fsdp2.adapters.methods import _weightless, check_replayable, replay_adapters


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the row to this file")
    return parser.parse_args()


def skeleton(args: argparse.Namespace) -> torch.nn.Module:
    """A Llama of the given size on the meta device (no weights anywhere)."""
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128, vocab_size=32000,
    )  # fmt: skip
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def median_seconds(run: Any, repeats: int) -> float:
    """Median wall time of `run()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    base = skeleton(args)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=args.rank, target_modules=targets))
    once = median_seconds(lambda: replay_adapters(_weightless(copy.deepcopy(base)), model), args.repeats)
    checked = median_seconds(lambda: check_replayable(model, copy.deepcopy(base)), args.repeats)
    row = {
        "hidden": args.hidden, "layers": args.layers, "rank": args.rank,
        "base_parameters": sum(p.numel() for p in base.parameters()),
        "adapter_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
        "one_replay_s": round(once, 3), "checked_pair_s": round(checked, 3),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }  # fmt: skip
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(row, handle, indent=2)


if __name__ == "__main__":
    main()
