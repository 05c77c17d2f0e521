"""The GPU check's results as the markdown tables docs/performance.md shows."""

from __future__ import annotations

from gpu_parts.checkpoints import checkpoint_table
from gpu_parts.collectives import collectives_table
from gpu_parts.cuda_tests import cuda_tests_table
from gpu_parts.fp8 import fp8_table
from gpu_parts.generation import generation_table
from gpu_parts.offload import offload_table
from gpu_parts.planner import planner_table
from gpu_parts.switches import switches_table
from gpu_parts.training import compile_table, parity_table, simple_table, throughput_table
from gpu_parts.two_ranks import two_ranks_table


def render_markdown(results: dict) -> str:
    """The GPU tables of the README, from a results file."""
    env = results.get("environment", {})
    parts = results["parts"]
    calls = [*results.get("earlier_calls_wall_s", []), results.get("wall_s", 0)]
    took = " + ".join(f"{(seconds or 0) / 60:.1f}" for seconds in calls)
    lines = [
        f"Measured on {env.get('device_name', '?')} ({env.get('date', '?')}; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}) with `python scripts/measure/gpu_check.py`: {took} min"
        + (f" in {len(calls)} calls (the later ones with `--keep`)." if len(calls) > 1 else "."),
        "",
        "| part | status | seconds | call |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| {name} | {p['status']} | {p.get('seconds', '')} | {p.get('call', len(calls))} |"
        for name, p in parts.items()
    ]
    lines += collectives_table(parts.get("collectives", {}))
    lines += cuda_tests_table(parts.get("cuda_tests", {}))
    lines += two_ranks_table(parts.get("two_ranks", {}))
    lines += switches_table(parts)
    lines += parity_table(parts.get("parity", {}))
    lines += throughput_table(parts, env)
    lines += compile_table(parts, env)
    lines += fp8_table(parts, env)
    lines += simple_table(parts, "qlora", ["load_peak_mib", "train_peak_mib", "step_median_s", "tokens_per_s"])
    lines += simple_table(parts, "long_rows", ["train_peak_mib", "step_median_s", "tokens_per_s"])
    lines += offload_table(parts)
    lines += generation_table(parts.get("generation", {}))
    lines += checkpoint_table(parts.get("checkpoints", {}))
    lines += planner_table(parts.get("planner", {}))
    return "\n".join(lines)
