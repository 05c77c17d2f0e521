"""Part "planner": `hf-fsdp2 plan` against every FSDP2Trainer peak the other parts measured."""

from __future__ import annotations

from gpu_parts.common import model_path, on_cuda

# Parts whose runs the planner is not held against: parity, and switches (`plan` takes no fp16 or Liger).
SKIPPED = ("parity", "switches")


def measured_for_planner(results: dict) -> list[dict]:
    """Every FSDP2Trainer training run measured so far, with what the planner needs to plan it again."""
    keys = ("model", "bf16", "batch", "seq", "ac", "offload", "chunk", "adapter", "compile")
    out = []
    for part, outcome in results["parts"].items():
        for name, run in outcome.get("runs", {}).items():
            spec = run.get("spec", {})
            ours = spec.get("system", "hf_fsdp2") == "hf_fsdp2" and not spec.get("float8")  # `plan` takes no float8
            if ours and "train_peak_mib" in run and part not in SKIPPED:
                out.append(
                    {
                        "run": f"{part}: {name}",
                        "train_peak_mib": run["train_peak_mib"],
                        **{k: spec.get(k) for k in keys},
                    }
                )
    return out


def planner(spec: dict) -> dict:
    """`hf-fsdp2 plan` (for a GPU; on the CPU rehearsal, for the CPU) against every measured FSDP2Trainer peak."""
    import torch
    from benchmark_systems import LORA

    import hf_fsdp2

    memory = torch.cuda.get_device_properties(0).total_memory if on_cuda() else None
    rows = []
    for run in spec["measured"]:
        if run["offload"] and not on_cuda():
            continue  # the trainer refuses cpu_offload without an accelerator, and so does the planner
        adapter = run["adapter"]
        planned = hf_fsdp2.plan(
            model_path(run["model"]), nproc=1, bf16=bool(run["bf16"]), batch=run["batch"], seq=run["seq"],
            activation_checkpointing=bool(run["ac"]), cpu_offload=bool(run["offload"]),
            lora_r=16 if adapter else None, qlora=adapter == "qlora", loss_chunk_size=run["chunk"],
            cpu=not on_cuda(), device_memory=memory, compile=bool(run["compile"]),
            **({"lora_targets": tuple(LORA["target_modules"])} if adapter else {}),
        )  # fmt: skip
        planned_mib = planned.training_peak / 2**20
        error = planned_mib / run["train_peak_mib"] - 1 if run["train_peak_mib"] > 0 else None
        rows.append({"run": run["run"], "planned_mib": round(planned_mib, 1), "measured_mib": run["train_peak_mib"]})
        rows[-1]["error"] = round(error, 3) if error is not None else None
    return {"rows": rows}


def planner_table(part: dict) -> list[str]:
    rows = part.get("runs", {}).get("planner", {}).get("rows", [])
    if not rows:
        return []
    lines = ["", "| planned against measured | planned | measured | error |", "|---|---:|---:|---:|"]
    for row in rows:
        error = f"{row['error']:+.1%}" if row["error"] is not None else "n/a"
        lines.append(f"| {row['run']} | {row['planned_mib']:,} MiB | {row['measured_mib']:,} MiB | {error} |")
    return lines
