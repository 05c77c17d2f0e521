"""Part "generation": greedy generate of the gathered sharded model against the plain one, alternating."""

from __future__ import annotations

import time
from typing import Any

from gpu_parts.common import dry_run, free_memory, model_path, on_cuda
from gpu_parts.training import run_ok

GENERATION_REPEATS = 3


def generate(spec: dict) -> dict:
    """Greedy generate tokens/s: the model sharded by FSDP2 and gathered for generate, against the plain model."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    import hf_fsdp2
    from hf_fsdp2.distributed import get_device

    path, new = model_path(spec["model"]), 128 if not dry_run() else 8
    device = get_device()
    ids = torch.randint(0, 1000, (spec["batch"], spec["prompt"]), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    dtype = torch.bfloat16
    models = {
        "unsharded": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(),
        "gathered": lambda: hf_fsdp2.prepare_model(
            hf_fsdp2.from_pretrained(path, dtype=dtype), hf_fsdp2.FSDP2Config(gather_for_generate=True)
        ).eval(),
    }
    record: dict[str, Any] = {"new_tokens": new, "repeats": GENERATION_REPEATS}
    built = {name: make() for name, make in models.items()}
    outputs, seconds = {}, {name: [] for name in built}
    with torch.no_grad():
        for model in built.values():
            model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up: kernels, caches, the gather path
        # NOTE: alternating order, so neither model always runs first (the first timed run of a process was the
        # slow one: 2.8x in an earlier check that timed the unsharded model first, once).
        for repeat in range(GENERATION_REPEATS):
            for name in list(built) if repeat % 2 == 0 else list(built)[::-1]:
                start = time.perf_counter()
                outputs[name] = built[name].generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
                if on_cuda():
                    torch.cuda.synchronize()
                seconds[name].append(round(time.perf_counter() - start, 3))
    for name, times in seconds.items():
        median = statistics.median(times)
        record[name] = {"seconds": times, "tokens_per_s": round(spec["batch"] * new / median, 1)}
    del built
    free_memory()
    record["same_tokens"] = bool(torch.equal(outputs["unsharded"], outputs["gathered"]))
    return record


def generation_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("generate", {})
    if not run or not run_ok(run):
        return []
    timing = f"; median of {run['repeats']}, alternating" if "repeats" in run else ""
    return [
        "",
        f"| generate ({run['new_tokens']} new tokens{timing}) | tokens/s | same tokens |",
        "|---|---:|---|",
        f"| unsharded | {run['unsharded']['tokens_per_s']:,} | |",
        f"| FSDP2, gathered | {run['gathered']['tokens_per_s']:,} | {run['same_tokens']} |",
    ]
