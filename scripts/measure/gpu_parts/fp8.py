"""Part "fp8": FP8 training at Llama-3.2-3B's shape with activation checkpointing (issue 63), each run compiled:
FSDP2Trainer in bf16, FSDP2Trainer with FSDP2Config(float8=True) (torchao's float8, FP8 all-gather), and Trainer +
Accelerate's FSDP2 plugin with Accelerate's own FP8 through torchao. Tokens/s, peak, and the losses of the same steps
against our bf16 run (tolerance: common.FP8_REL_TOLERANCE).

Where FP8 cannot run (the CPU rehearsal, a GPU below compute capability 8.9), FSDP2Trainer refuses float8=True by
name: the run records that refusal ("skipped"), and Accelerate's run is not tried. Accelerate's run is the peer's
path, so its failure is recorded with its message and does not fail the part.
"""

from __future__ import annotations

import traceback

from gpu_parts.common import FP8_REL_TOLERANCE
from gpu_parts.switches import loss_difference, not_trained
from gpu_parts.training import mfu, train

FP8_CAPABILITY = (8, 9)
REFERENCE = "hf_fsdp2 bf16 compile"


def plan_fp8(big: dict) -> list[dict]:
    """The part's runs: 3B, activation checkpointing, compiled; 8 steps, 3 of them warm-up (FP8's casts compile in
    the first)."""
    base = dict(big, model="m3b", ac=True, compile=True, steps=8, warmup=3, kind="fp8")
    return [
        dict(base, name=REFERENCE, system="hf_fsdp2"),
        dict(base, name="hf_fsdp2 fp8 compile", system="hf_fsdp2", float8=True),
        dict(base, name="accelerate fp8 compile", system="accelerate", fp8=True),
    ]


def fp8_machine() -> str | None:
    """Why this machine has no FP8 matmuls, or None when it has them."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA"
    capability = torch.cuda.get_device_capability(0)
    if capability < FP8_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} (FP8 needs 8.9)"
    return None


def fp8_run(spec: dict) -> dict:
    """Train one run; FSDP2Trainer's refusal of float8 where it cannot run is recorded as the run's outcome."""
    missing = fp8_machine()
    if spec.get("fp8") and missing is not None:
        return {"status": f"skipped: {missing}", "refused": "not tried: Accelerate's FP8 needs FP8 matmuls too"}
    if spec.get("float8"):
        try:
            return train(spec)
        except ValueError as error:
            if missing is None or "FP8 tensor cores" not in str(error):
                raise
            return {"status": f"skipped: {missing}", "refused": str(error)[:600]}
    if spec.get("fp8"):
        try:
            return train(spec)
        except Exception as error:  # noqa: BLE001 - the peer's path: recorded, and the part still counts ours
            traceback.print_exc()
            return {"status": "failed (Accelerate's FP8)", "failure": f"{type(error).__name__}: {error}"[-1500:]}
    return train(spec)


def fp8_table(parts: dict, env: dict) -> list[str]:
    """The part's runs against our bf16 compiled run: tokens/s, MFU (against the bf16 peak), peak, the speed-up, and
    the largest loss difference over the same steps."""
    runs = parts.get("fp8", {}).get("runs", {})
    if not runs:
        return []
    reference = runs.get(REFERENCE, {})
    steps = reference.get("spec", {})
    title = f"fp8 (3B, AC, {steps.get('batch', '?')} x {steps.get('seq', '?')} tokens, compiled)"
    lines = [
        "",
        f"| {title} | tokens/s | MFU (bf16 peak) | peak allocated | ÷ {REFERENCE} | max loss difference from bf16 |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, run in runs.items():
        reason = not_trained(run)
        if reason is not None:
            why = run.get("refused") or run.get("failure") or ""
            lines.append(f"| {name} | {reason} | | | | {why[:160].replace('|', '/')} |")
            continue
        share = mfu(run, env)
        speedup = f"{run['tokens_per_s'] / reference['tokens_per_s']:.2f}×" if "tokens_per_s" in reference else ""
        diff = loss_difference(run, reference, FP8_REL_TOLERANCE) if "losses" in reference else ""
        lines.append(
            f"| {name} | {run['tokens_per_s']:,.0f} | {f'{share:.1%}' if share is not None else 'n/a'} | "
            f"{run['train_peak_mib']:,.0f} MiB | {speedup} | {diff} |"
        )
    return lines
