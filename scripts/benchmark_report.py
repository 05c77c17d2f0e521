"""Turn the benchmark's raw runs into figures (medians, min–max, ratios against Trainer + Accelerate's
FSDP2), the issue's targets checked against them, a markdown table and a PNG chart.
"""

from __future__ import annotations

import argparse
import statistics

REFERENCE = "accelerate_fsdp2"
MIB = 2**20
# Dense peak FLOP/s per GPU for the compute dtype the benchmark uses on CUDA (bf16), by device-name fragment.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}

# (key, label, unit, lower is better)
METRICS = (
    ("load_s", "load: time to first step, slowest rank", "s", True),
    ("load_peak_mib", "load: peak host RAM, worst rank", "MiB", True),
    ("load_gpu_peak_mib", "load: peak GPU memory, worst rank", "MiB", True),
    ("step_s", "training step (steady state)", "s", True),
    ("tokens_per_s", "throughput, all ranks", "tokens/s", False),
    ("mfu", "MFU (bf16 dense peak)", "%", False),
    ("train_peak_mib", "training: peak host RAM, worst rank", "MiB", True),
    ("train_gpu_peak_mib", "training: peak GPU memory, worst rank", "MiB", True),
    ("signal_check_ms", "preemption check (SIGTERM agreement), per step", "ms", True),
    ("save_s", "checkpoint save: loop blocked per save", "s", True),
    ("checkpoint_mib", "checkpoint on disk", "MiB", True),
    ("resume_s", "resume: checkpoint load, slowest rank", "s", True),
    ("consolidate_s", "consolidation to safetensors: time", "s", True),
    ("consolidate_peak_mib", "consolidation: peak RAM", "MiB", True),
)


def _run_figures(run: dict, args: argparse.Namespace, flops_per_token: float, peak_flops: float | None) -> dict:
    """The figures of one run; per-rank values reduced to the slowest/largest rank."""
    ranks = run["ranks"]
    step = max(statistics.median(r["step_s"][args.warmup :] or r["step_s"]) for r in ranks)
    tokens = args.batch * args.nproc * args.seq_len
    figures = {
        "load_s": max(r["load_s"] for r in ranks),
        "load_peak_mib": max(r["load_peak_mib"] for r in ranks),
        "step_s": step,
        "tokens_per_s": tokens / step,
        "train_peak_mib": max(r["train_peak_mib"] for r in ranks),
        "save_s": statistics.median(max(saves) for saves in zip(*(r["save_s"] for r in ranks), strict=True)),
        "checkpoint_mib": run["checkpoint_bytes"] / MIB,
        "final_loss": ranks[0]["final_loss"],
        "per_rank": [{"load_peak_mib": r["load_peak_mib"], "train_peak_mib": r["train_peak_mib"]} for r in ranks],
    }
    if ranks[0].get("signal_check_s"):
        figures["signal_check_ms"] = 1000 * max(statistics.median(r["signal_check_s"]) for r in ranks)
    if ranks[0].get("resume_s"):
        figures["resume_s"] = max(sum(r["resume_s"]) for r in ranks)
        figures["loss_after_resume"] = ranks[0]["loss_after_resume"]
    if ranks[0].get("load_gpu_peak_mib") is not None:
        figures["load_gpu_peak_mib"] = max(r["load_gpu_peak_mib"] for r in ranks)
        figures["train_gpu_peak_mib"] = max(r["train_gpu_peak_mib"] for r in ranks)
        if peak_flops:
            figures["mfu"] = 100 * flops_per_token * figures["tokens_per_s"] / (peak_flops * args.nproc)
    if "consolidate" in run:
        figures["consolidate_s"] = run["consolidate"]["seconds"]
        figures["consolidate_peak_mib"] = run["consolidate"]["peak_mib"]
    return figures


def flops_per_token(args: argparse.Namespace) -> float:
    """Training FLOPs per token of the benchmark's Llama: 6 × parameters in matmuls + attention scores."""
    h, layers = args.hidden, args.layers
    matmul_params = layers * (4 * h * h + 3 * h * (h * 8 // 3)) + args.vocab * h
    return 6 * matmul_params + 12 * layers * h * args.seq_len


def peak_bf16_flops() -> float | None:
    """Dense bf16 peak of this machine's GPU, when it is one we know; None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for fragment, flops in PEAK_BF16_FLOPS.items() if fragment in name), None)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace, model_bytes: int) -> dict:
    """Medians and spreads per system and metric, loss agreement, and the targets."""
    fpt, peak = flops_per_token(args), peak_bf16_flops()
    figures = {
        system: [_run_figures(run, args, fpt, peak) for run in system_runs] for system, system_runs in runs.items()
    }
    systems: dict[str, dict] = {}
    for system, per_run in figures.items():
        systems[system] = {key: _spread([f[key] for f in per_run]) for key, *_ in METRICS if key in per_run[0]}
        systems[system]["final_loss"] = [f["final_loss"] for f in per_run]
        systems[system]["loss_after_resume"] = [f.get("loss_after_resume") for f in per_run]
        systems[system]["per_rank"] = [f["per_rank"] for f in per_run]
    summary = {
        "model_bytes": model_bytes,
        "nproc": args.nproc,
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "tokens_per_step": args.batch * args.nproc * args.seq_len,
        "seq_len": args.seq_len,
        "systems": systems,
        "flops_per_token": fpt,
        "peak_flops": peak,
    }
    # Ratios are against Trainer + Accelerate's FSDP2 when it ran, else against the first system.
    summary["reference"] = REFERENCE if REFERENCE in systems else next(iter(systems))
    summary["loss_agreement"] = _loss_agreement(systems)
    summary["targets"] = _targets(systems, model_bytes)
    return summary


def _loss_agreement(systems: dict[str, dict]) -> dict:
    """Largest difference of any run's final loss from the DDP reference (or the first system)."""
    reference = "ddp" if "ddp" in systems else next(iter(systems))
    ref = statistics.median(systems[reference]["final_loss"])
    return {
        "reference": reference,
        "reference_loss": ref,
        "max_abs_diff": {s: max(abs(x - ref) for x in v["final_loss"]) for s, v in systems.items()},
    }


def _median(systems: dict[str, dict], system: str, key: str) -> float | None:
    return systems.get(system, {}).get(key, {}).get("median")


def _targets(systems: dict[str, dict], model_bytes: int) -> list[dict]:
    """The issue's targets, each with the measured value and whether it is met (None: not measured)."""
    model_mib = model_bytes / MIB
    ours, ref = "hf_fsdp2", REFERENCE

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    rows = [
        ("peak load RAM, worst rank ≤ 0.6× model", ratio(_median(systems, ours, "load_peak_mib"), model_mib), 0.6),
        (
            "training step time ≤ 1.0× accelerate_fsdp2",
            ratio(_median(systems, ours, "step_s"), _median(systems, ref, "step_s")),
            1.0,
        ),
        (
            "checkpoint bytes ≤ accelerate_fsdp2's",
            ratio(_median(systems, ours, "checkpoint_mib"), _median(systems, ref, "checkpoint_mib")),
            1.0,
        ),
        (
            "blocked save time with async_save ≤ 0.3× sync",
            ratio(_median(systems, "hf_fsdp2_async", "save_s"), _median(systems, ours, "save_s")),
            0.3,
        ),
        (
            "preemption check ≤ 1% of step time",
            ratio(_median(systems, ours, "signal_check_ms"), 1000 * (_median(systems, ours, "step_s") or 0)),
            0.01,
        ),
        ("consolidation peak RAM ≤ 0.3× model", ratio(_median(systems, ours, "consolidate_peak_mib"), model_mib), 0.3),
        (
            "consolidation time ≤ accelerate merge-weights",
            ratio(_median(systems, ours, "consolidate_s"), _median(systems, ref, "consolidate_s")),
            1.0,
        ),
    ]
    return [
        {"target": name, "measured": value, "limit": limit, "met": None if value is None else value <= limit}
        for name, value, limit in rows
    ]


def _cell(stats: dict, reference: dict | None, digits: int) -> str:
    text = f"{stats['median']:.{digits}f}"
    if stats["n"] > 1:
        text += f" ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"
    if reference and reference["median"]:
        text += f" **{stats['median'] / reference['median']:.2f}×**"
    return text


def _ratio_text(value: float) -> str:
    """Two decimals, or four for the small ratios (a per-step check against a step)."""
    return f"{value:.2f}×" if value >= 0.1 else f"{value:.4f}×"


def render_markdown(summary: dict) -> str:
    """The benchmark's tables: figures with ratios to the reference, per-rank memory, losses, targets."""
    systems, reference = summary["systems"], summary["reference"]
    names = list(systems)
    lines = [
        f"Model {summary['model_bytes'] / MIB:.0f} MiB, {summary['nproc']} ranks, {summary['repeats']} runs per "
        f"system, {summary['steps']} steps of {summary['tokens_per_step']} tokens (first {summary['warmup']} "
        f"left out of step time). Median (min–max); **ratio** to {reference}.",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key, label, unit, _ in METRICS:
        if not any(key in systems[s] for s in names):
            continue
        digits = {"MiB": 0, "tokens/s": 0, "ms": 3}.get(unit, 2)
        cells = [
            _cell(systems[s][key], systems[reference].get(key), digits) if key in systems[s] else "–" for s in names
        ]
        lines.append(f"| {label} ({unit}) | " + " | ".join(cells) + " |")
    agreement = summary["loss_agreement"]
    lines += [
        "",
        f"Final training loss (reference {agreement['reference']}: {agreement['reference_loss']:.6f}):",
        "",
        "| system | final loss per run | largest difference from the reference | loss of the step after resume |",
        "|---|---|---:|---|",
    ]
    for s in names:
        losses = ", ".join(f"{x:.6f}" for x in systems[s]["final_loss"])
        resumed = ", ".join(f"{x:.6f}" for x in systems[s]["loss_after_resume"] if x is not None) or "–"
        lines.append(f"| {s} | {losses} | {agreement['max_abs_diff'][s]:.2e} | {resumed} |")
    lines += [
        "",
        "Peak host RAM per rank, median over runs (MiB; × model size):",
        "",
        "| system | rank | load | training |",
        "|---|---:|---:|---:|",
    ]
    model_mib = summary["model_bytes"] / MIB
    for s in names:
        per_run = systems[s]["per_rank"]
        for rank in range(len(per_run[0])):
            load = statistics.median(run[rank]["load_peak_mib"] for run in per_run)
            train = statistics.median(run[rank]["train_peak_mib"] for run in per_run)
            lines.append(f"| {s} | {rank} | {load:.0f} ({load / model_mib:.2f}×) | {train:.0f} |")
    lines += ["", "How each system ran:", ""]
    lines += [f"- **{s}**: {systems[s]['notes']}" for s in names if systems[s].get("notes")]
    lines += ["", "| target | measured | met |", "|---|---:|---|"]
    for row in summary["targets"]:
        measured = "not measured" if row["measured"] is None else _ratio_text(row["measured"])
        met = {True: "yes", False: "**no**", None: "–"}[row["met"]]
        lines.append(f"| {row['target']} | {measured} | {met} |")
    return "\n".join(lines) + "\n"


def render_png(summary: dict, path: str) -> None:
    """A bar chart, one panel per metric, of each system's median relative to the reference (line at 1)."""
    from hf_fsdp2.jobs.charts import bar_chart_png

    systems, reference = summary["systems"], summary["reference"]
    panels: dict[str, dict[str, float]] = {}
    for key, label, unit, _ in METRICS:
        ref = systems[reference].get(key)
        if not ref or not ref["median"]:
            continue
        panels[f"{label} ({unit}), ratio to {reference}"] = {
            s: v[key]["median"] / ref["median"] for s, v in systems.items() if key in v
        }
    bar_chart_png(panels, path, reference=1.0)
