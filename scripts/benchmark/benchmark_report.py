"""Turn the benchmark's raw runs into figures (medians, min–max, ratios against Trainer + Accelerate's
FSDP2), the issue's targets checked against them, a markdown table and a PNG chart.
"""

from __future__ import annotations

import argparse
import statistics

REFERENCE = "accelerate_fsdp2"
# The adapter rows train something else (LoRA on a frozen base): compared with each other, LoRA the reference.
ADAPTERS = ("hf_fsdp2_lora", "hf_fsdp2_qlora")
ADAPTER_REFERENCE = "hf_fsdp2_lora"
MIB = 2**20
# Dense peak FLOP/s per GPU for the compute dtype the benchmark uses on CUDA (bf16), by device-name fragment.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}

# (key, label, unit, lower is better)
METRICS = (
    ("load_s", "load: time to first step, slowest rank", "s", True),
    ("load_peak_mib", "load: peak host RAM, worst rank", "MiB", True),
    ("load_gpu_peak_mib", "load: peak GPU memory, worst rank", "MiB", True),
    ("file_view_pct", "load: weights left as views of the checkpoint file", "% of bytes", True),
    ("first_step_s", "first training step (pays what loading deferred)", "s", True),
    ("ready_s", "load + first step: until the weights have moved once", "s", True),
    ("step_s", "training step (steady state)", "s", True),
    ("tokens_per_s", "throughput, all ranks", "tokens/s", False),
    ("mfu", "MFU (bf16 dense peak)", "%", False),
    ("train_peak_mib", "training: peak host RAM, worst rank", "MiB", True),
    ("train_gpu_peak_mib", "training: peak GPU memory, worst rank", "MiB", True),
    ("gathered_mib", "all-gathered per step, per rank", "MiB", True),
    ("base_mib", "frozen base held per rank", "MiB", True),
    ("signal_check_ms", "preemption check (SIGTERM agreement), per step", "ms", True),
    ("save_s", "checkpoint save: loop blocked per save", "s", True),
    ("checkpoint_mib", "checkpoint on disk", "MiB", True),
    ("resume_s", "resume: checkpoint load, slowest rank", "s", True),
    ("consolidate_s", "consolidation to safetensors: time", "s", True),
    ("consolidate_peak_mib", "consolidation: peak RAM", "MiB", True),
    ("consolidate_command_s", "consolidation command: start to exit (imports included)", "s", True),
)


def _run_figures(run: dict, args: argparse.Namespace, flops_per_token: float, peak_flops: float | None) -> dict:
    """The figures of one run; per-rank values reduced to the slowest/largest rank."""
    ranks = run["ranks"]
    step = max(statistics.median(r["step_s"][args.warmup :] or r["step_s"]) for r in ranks)
    tokens = args.batch * args.nproc * args.seq_len
    figures = {
        "load_s": max(r["load_s"] for r in ranks),
        # NOTE: weights left memory-mapped (transformers' native FSDP2) are copied on write by the first optimizer
        # step; the first step is left out of step time, so these two rows keep that work in view.
        "first_step_s": max(r["step_s"][0] for r in ranks),
        "ready_s": max(r["load_s"] + r["step_s"][0] for r in ranks),
        "load_peak_mib": max(r["load_peak_mib"] for r in ranks),
        "step_s": step,
        "tokens_per_s": tokens / step,
        "train_peak_mib": max(r["train_peak_mib"] for r in ranks),
        "save_s": statistics.median(max(saves) for saves in zip(*(r["save_s"] for r in ranks), strict=True)),
        "checkpoint_mib": run["checkpoint_bytes"] / MIB,
        "final_loss": ranks[0]["final_loss"],
        "per_rank": [{"load_peak_mib": r["load_peak_mib"], "train_peak_mib": r["train_peak_mib"]} for r in ranks],
    }
    if any(r.get("gathered_bytes") for r in ranks):
        figures["gathered_mib"] = max(statistics.median(r["gathered_bytes"][args.warmup :]) for r in ranks) / MIB
    if "base_bytes" in ranks[0] and ranks[0]["base_bytes"]:
        figures["base_mib"] = max(r["base_bytes"] for r in ranks) / MIB
        figures["memory"] = {key: max(r[key] for r in ranks) for key in _MEMORY_KEYS if key in ranks[0]}
    if ranks[0].get("signal_check_s"):
        figures["signal_check_ms"] = 1000 * max(statistics.median(r["signal_check_s"]) for r in ranks)
    if ranks[0].get("resume_s"):
        figures["resume_s"] = max(sum(r["resume_s"]) for r in ranks)
        figures["loss_after_resume"] = ranks[0]["loss_after_resume"]
    if ranks[0].get("file_view_bytes") is not None and ranks[0].get("param_bytes"):
        figures["file_view_pct"] = 100 * max(r["file_view_bytes"] / r["param_bytes"] for r in ranks)
    if ranks[0].get("load_gpu_peak_mib") is not None:
        figures["load_gpu_peak_mib"] = max(r["load_gpu_peak_mib"] for r in ranks)
        figures["train_gpu_peak_mib"] = max(r["train_gpu_peak_mib"] for r in ranks)
        if peak_flops:
            figures["mfu"] = 100 * flops_per_token * figures["tokens_per_s"] / (peak_flops * args.nproc)
    if ranks[0].get("runtime_peak_mib") is not None:  # the load peak less the runtime's (process group, torchao)
        figures["load_above_runtime_mib"] = max(r["load_peak_mib"] - r["runtime_peak_mib"] for r in ranks)
    if "consolidate" in run:
        figures["consolidate_s"] = run["consolidate"]["seconds"]
        figures["consolidate_peak_mib"] = run["consolidate"]["peak_mib"]
        if "command_s" in run["consolidate"]:  # benchmarks before 2026-11-26 did not time the command
            figures["consolidate_command_s"] = run["consolidate"]["command_s"]
    return figures


_MEMORY_KEYS = ("param_bytes", "base_bytes", "base_numel", "nf4_bytes", "nf4_numel", "largest_slice_bytes")


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
        if "memory" in per_run[0]:
            systems[system]["memory"] = per_run[0]["memory"]  # the same every run: what the model holds
            systems[system]["load_above_runtime_mib"] = _spread(
                [f["load_above_runtime_mib"] for f in per_run if "load_above_runtime_mib" in f] or [0.0]
            )
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
    dense = {s: v for s, v in systems.items() if s not in ADAPTERS}
    adapters = {s: v for s, v in systems.items() if s in ADAPTERS}
    summary["loss_agreement"] = _loss_agreement(dense or systems)
    if adapters:
        summary["adapter_loss_agreement"] = _loss_agreement(adapters, ADAPTER_REFERENCE)
    summary["targets"] = _targets(systems, model_bytes)
    return summary


def _loss_agreement(systems: dict[str, dict], preferred: str = "ddp") -> dict:
    """Largest difference of any run's final loss from the reference (DDP; else the first system)."""
    reference = preferred if preferred in systems else next(iter(systems))
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
        *(
            (f"{label} ≤ 1.0× {peer}", ratio(_median(systems, ours, key), _median(systems, peer, key)), 1.0)
            for label, key, peer in (
                ("load time", "load_s", "transformers_fsdp2"),
                ("load + first step", "ready_s", "transformers_fsdp2"),
                ("resume time", "resume_s", ref),
                ("checkpoint save (sync)", "save_s", ref),
                ("training step time", "step_s", ref),
            )
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
        (
            "consolidation command, start to exit ≤ accelerate merge-weights",
            ratio(_median(systems, ours, "consolidate_command_s"), _median(systems, ref, "consolidate_command_s")),
            1.0,
        ),
    ]
    if "hf_fsdp2_qlora" in systems:
        rows += _qlora_targets(systems)
    return [
        {"target": name, "measured": value, "limit": limit, "met": None if value is None else value <= limit}
        for name, value, limit in rows
    ]


def _qlora_targets(systems: dict[str, dict]) -> list[tuple[str, float | None, float]]:
    """Issue 22's QLoRA targets: NF4 bytes against bf16, and the load peak against what a rank must hold."""
    qlora = systems.get("hf_fsdp2_qlora", {})
    memory = qlora.get("memory", {})
    nf4_ratio = memory["nf4_bytes"] / (2 * memory["nf4_numel"]) if memory.get("nf4_numel") else None
    needed = memory.get("param_bytes", 0) + memory.get("largest_slice_bytes", 0)
    load = qlora.get("load_above_runtime_mib", {}).get("median")
    return [
        ("QLoRA: NF4 weights per rank ≤ 0.27× the same weights in bf16", nf4_ratio, 0.27),
        (
            "QLoRA: load peak above the runtime's ≤ 1.1× (parameters per rank + one slice)",
            load * MIB / needed if load is not None and needed else None,
            1.1,
        ),
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


def _figure_table(systems: dict[str, dict], names: list[str], reference: str) -> list[str]:
    """One table of every metric for `names`, each cell with its ratio to `reference`."""
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for key, label, unit, _ in METRICS:
        if not any(key in systems[s] for s in names):
            continue
        digits = {"MiB": 0, "tokens/s": 0, "ms": 3, "% of bytes": 0}.get(unit, 2)
        cells = [
            _cell(systems[s][key], systems[reference].get(key), digits) if key in systems[s] else "–" for s in names
        ]
        lines.append(f"| {label} ({unit}) | " + " | ".join(cells) + " |")
    return lines


def render_markdown(summary: dict) -> str:
    """The benchmark's tables: figures with ratios to the reference, per-rank memory, losses, targets."""
    systems, reference = summary["systems"], summary["reference"]
    names = list(systems)
    dense = [s for s in names if s not in ADAPTERS]
    adapters = [s for s in names if s in ADAPTERS]
    lines = [
        f"Model {summary['model_bytes'] / MIB:.0f} MiB, {summary['nproc']} ranks, {summary['repeats']} runs per "
        f"system, {summary['steps']} steps of {summary['tokens_per_step']} tokens (first {summary['warmup']} "
        f"left out of step time). Median (min–max); **ratio** to {reference if dense else ADAPTER_REFERENCE}.",
        "",
    ]
    if dense:
        lines += _figure_table(systems, dense, reference)
    if adapters:
        ref = ADAPTER_REFERENCE if ADAPTER_REFERENCE in adapters else adapters[0]
        runs = systems[ref]["step_s"]["n"]
        lines += ["", f"Adapter training (LoRA r=16 on every projection; {runs} run(s) each), **ratio** to {ref}:", ""]
        lines += _figure_table(systems, adapters, ref)
    agreement = summary["loss_agreement"]
    lines += [
        "",
        f"Final training loss (reference {agreement['reference']}: {agreement['reference_loss']:.6f}"
        + (f"; adapter rows against {ADAPTER_REFERENCE}, QLoRA's base being quantized):" if adapters else "):"),
        "",
        "| system | final loss per run | largest difference from the reference | loss of the step after resume |",
        "|---|---|---:|---|",
    ]
    differences = {**agreement["max_abs_diff"], **summary.get("adapter_loss_agreement", {}).get("max_abs_diff", {})}
    for s in names:
        losses = ", ".join(f"{x:.6f}" for x in systems[s]["final_loss"])
        resumed = ", ".join(f"{x:.6f}" for x in systems[s]["loss_after_resume"] if x is not None) or "–"
        lines.append(f"| {s} | {losses} | {differences[s]:.2e} | {resumed} |")
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


def emit_markdown(markdown: str, path: str | None) -> None:
    """Print a rendered table, and write it to `path` when one is given."""
    print(markdown)
    if path:
        with open(path, "w") as f:
            f.write(markdown)


def render_png(summary: dict, path: str) -> None:
    """A bar chart, one panel per metric, of each system's median relative to the reference (line at 1)."""
    from hf_fsdp2.jobs.charts import bar_chart_png

    systems, reference = summary["systems"], summary["reference"]
    panels: dict[str, dict[str, float]] = {}
    groups = [(reference, [s for s in systems if s not in ADAPTERS])]
    if ADAPTER_REFERENCE in systems and reference != ADAPTER_REFERENCE:
        groups.append((ADAPTER_REFERENCE, [s for s in systems if s in ADAPTERS]))
    for ref_name, names in groups:
        for key, label, unit, _ in METRICS:
            ref = systems[ref_name].get(key)
            if not ref or not ref["median"]:
                continue
            panels[f"{label} ({unit}), ratio to {ref_name}"] = {
                s: systems[s][key]["median"] / ref["median"] for s in names if key in systems[s]
            }
    bar_chart_png(panels, path, reference=1.0)
