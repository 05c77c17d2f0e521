"""Seconds to hand vLLM the full weights of a sharded model once (GRPO's weight sync), at N CPU ranks over gloo.

Two ways over the same `prepare_model`-sharded Llama, each a full pass over every weight:
- TRL: TRL 1.16's own FSDP2 path (`VLLMGeneration._iter_fsdp2_params`), what TRL + Accelerate's FSDP2 plugin run:
  `full_tensor()` on each parameter in turn, one all-gather each, in the parameters' dtype (fp32 masters);
- hf_fsdp2: `export.engine_weights.named_full_weights`: each FSDP unit all-gathered once, in its compute dtype.
Only the gathering is timed (a consumer that drops each tensor): loading into vLLM is the engine's cost, the same for
both, and vLLM's CPU build loads through a test-only adapter that would dominate here. Every rank iterates, as both
must (the gathers are collectives); the time is rank 0's, median of `--repeats` passes after one warm-up pass, all
ranks synchronised by a barrier before each pass; the two ways alternate pass by pass.

Usage:
    python scripts/measure/measure_vllm_sync.py [--nproc 2] [--preset qwen0.5b] [--json scripts/results/vllm_sync.json]
    python scripts/measure/measure_vllm_sync.py --from-json scripts/results/vllm_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

# Llama shapes: a tiny one, and Qwen2.5-0.5B's (hidden 896, 24 layers, GQA 14/2, vocab 151,936, tied).
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=96, tie_word_embeddings=True),
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), nargs="+", default=["tiny", "qwen0.5b"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--from-json", default=None, help="print the table of a results file, run nothing")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)  # preset, precision
    return parser.parse_args(argv)


def trl_pass(model: Any) -> int:
    """TRL 1.16's FSDP2 sync path, run as TRL runs it; returns the bytes it handed out."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    trl_self = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu")),
        _fix_param_name_to_vllm=lambda name, extra_prefixes=None: VLLMGeneration._fix_param_name_to_vllm(
            trl_self, name, extra_prefixes
        ),
    )
    return sum(t.numel() * t.element_size() for _, t in VLLMGeneration._iter_fsdp2_params(trl_self, model))


def ours_pass(model: Any) -> int:
    """hf_fsdp2's unit-by-unit pass; returns the bytes it handed out."""
    from hf_fsdp2.export.engine_weights import named_full_weights

    return sum(t.numel() * t.element_size() for _, t in named_full_weights(model))


def worker(preset: str, precision: str, repeats: int, out: str) -> None:
    """One rank: shard the preset's Llama with hf_fsdp2, time both passes; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2 import FSDP2Config, prepare_model

    torch.manual_seed(0)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**PRESETS[preset], max_position_embeddings=256))
    skeleton = LlamaForCausalLM(skeleton.config)  # random weights, the same on every rank (seeded)
    model = prepare_model(skeleton, FSDP2Config(consolidate_on_train_end=False), bf16=precision == "bf16")
    systems = {"TRL (per parameter)": trl_pass, "hf_fsdp2 (per unit)": ours_pass}
    times: dict[str, list[float]] = {name: [] for name in systems}
    handed: dict[str, int] = {}
    for _ in range(repeats + 1):  # NOTE: alternating, so neither always runs on the other's allocator state
        for name, one_pass in systems.items():
            dist.barrier()
            start = time.perf_counter()
            handed[name] = one_pass(model)
            times[name].append(time.perf_counter() - start)
    rows = [
        dict(preset=preset, precision=precision, system=name, nproc=dist.get_world_size(),
             seconds=statistics.median(times[name][1:]), handed_mib=handed[name] / 2**20,
             parameters=sum(p.numel() for p in model.parameters()))
        for name in systems
    ]  # fmt: skip
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """The table of a results file's rows, with hf_fsdp2's time as a share of TRL's."""
    lines = ["| model | precision | ranks | TRL (per parameter) | hf_fsdp2 (per unit) | ratio | handed out |"]
    lines.append("|---|---|---:|---:|---:|---:|---|")
    for key in dict.fromkeys((r["preset"], r["precision"], r["nproc"]) for r in rows):
        trl, ours = (next(r for r in rows if (r["preset"], r["precision"], r["nproc"]) == key and r["system"] == s)
                     for s in ("TRL (per parameter)", "hf_fsdp2 (per unit)"))  # fmt: skip
        lines.append(
            f"| {key[0]} ({trl['parameters'] / 1e6:,.1f}M) | {key[1]} | {key[2]} | {trl['seconds']:.3f} s | "
            f"{ours['seconds']:.3f} s | {ours['seconds'] / trl['seconds']:.2f}× | "
            f"{trl['handed_mib']:,.1f} / {ours['handed_mib']:,.1f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            return print(render_markdown(json.load(f)["rows"]))
    if args.worker:
        return worker(*args.worker, args.repeats, os.environ["MEASURE_OUT"])
    work, rows = tempfile.mkdtemp(prefix="hf_fsdp2_vllm_sync_"), []
    for preset in args.preset:
        for precision in ("fp32", "bf16"):
            out = os.path.join(work, f"{preset}-{precision}.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MEASURE_OUT": out}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
            command += [os.path.abspath(__file__), "--worker", preset, precision, "--repeats", str(args.repeats)]
            subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            with open(out) as f:
                rows += json.load(f)
            print(render_markdown(rows), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
