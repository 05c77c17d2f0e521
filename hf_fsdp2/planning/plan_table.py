"""The plan as `hf-fsdp2 plan` prints it: one row per phase with what it is made of, then the verdict and what
would fit instead."""

from __future__ import annotations

from .plan_types import MemoryPlan

GIB = 2**30


def format_plan(result: MemoryPlan) -> str:
    """The plan as a readable table: one row per phase, its parts, then the verdict."""
    r = result.request
    lines = [
        f"Plan for {r.model}: {r.nproc} rank(s){f' (HSDP {r.hsdp} replicas)' if r.hsdp > 1 else ''}, "
        f"{'bf16' if r.bf16 else 'checkpoint dtype'}, {f'LoRA r={r.lora_r}' if r.lora_r else 'full fine-tuning'}, "
        f"batch {r.batch} × seq {r.seq} per device, "
        f"activation checkpointing {'on' if r.activation_checkpointing else 'off'}"
        f"{', CPU offload' if r.cpu_offload else ''}"
        f"{f', loss in chunks of {r.loss_chunk_size} tokens' if r.loss_chunk_size else ''}"
        f"{f', rows split across {r.sequence_parallel} ranks' if r.sequence_parallel > 1 else ''}"
        f"{', blocks compiled' if r.compile else ''}, {r.optim}.",
        "",
        "| phase (per rank) | peak | made of |",
        "|---|---:|---|",
    ]
    for phase in result.phases:
        parts = ", ".join(f"{name} {gib(value)}" for name, value in phase.parts.items() if value >= 2**20)
        where = " (host)" if phase.where == "host" else ""
        lines.append(f"| {phase.name}{where} | {gib(phase.total)} | {parts} |")
    verdict = "fits" if result.fits else "does NOT fit"
    if result.not_traced is not None:
        lines += [
            "",
            f"Activations could not be traced ({result.not_traced}): the training figures leave them out, so they",
            "are lower bounds and no alternatives are planned. Measure a short run instead",
            "(scripts/measure/validate_plan.py).",
        ]
        verdict = "would fit before activations" if result.fits else "does NOT fit even before activations"
    lines += ["", f"Training peak {gib(result.training_peak)} per rank {verdict} in {gib(result.device_memory)}."]
    for alt in result.alternatives:
        lines.append(f"  fits with {alt['change']}: {gib(alt['training_peak'])}")
    if not result.fits and not result.alternatives and result.not_traced is None:
        lines.append("  no single change fits; combine them (more ranks with activation checkpointing and LoRA).")
    return "\n".join(lines)


def gib(value: int) -> str:
    """GiB with two decimals from 1 GiB up, whole MiB below."""
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / 2**20:.0f} MiB"
