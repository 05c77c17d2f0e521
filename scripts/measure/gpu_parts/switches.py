"""Part "switches": the `TrainingArguments` switches GPU users turn on (issue 61) that only a GPU can really run, each
held against plain Trainer with the same switch over the same steps, and their tables.

Liger runs last in each worker: liger-kernel 0.8.5 replaces `modeling_llama`'s RMSNorm, MLP and rotary embedding for the
whole process, so a run after it would train Liger's layers too. On the CPU rehearsal FSDP2Trainer refuses Liger by name
and plain Trainer is not tried (it does not check; Triton has no CPU backend): both are "skipped: no CUDA". Plain
`Trainer(fp16=True)` trains in fp32 there (Accelerate makes no scaler and no autocast on a CPU), so the rehearsal's
fp16 row holds our fp16 against fp32, and its table says which precision each run computed in.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from gpu_parts.common import BF16_REL_TOLERANCE, FP16_REL_TOLERANCE, on_cuda
from gpu_parts.training import train

# What `gpu_check.py --fetch-wheels` adds for this part: pure Python; its Triton comes with the GPU image's torch.
LIGER_WHEEL = "liger-kernel==0.8.5"
LIGER_ROWS = ("hf_fsdp2 liger", "trainer liger", "hf_fsdp2 loss_chunk_size")
FP16_ROWS = ("hf_fsdp2 fp16", "trainer fp16")
TRAINER_NOT_TRIED = (
    "plain Trainer does not check the device; Liger's kernels are Triton kernels and Triton has no CPU backend, so the "
    "run is not tried"
)


def plan_switches(big: dict, parity: dict, chunk: int) -> list[dict]:
    """The part's runs in the order each worker does them: fp16 first, Liger last (it patches the whole process)."""
    fp16 = [dict(parity, name=f"{system} fp16", system=system, fp16=True) for system in ("hf_fsdp2", "trainer")]
    chunked = dict(big, name="hf_fsdp2 loss_chunk_size", system="hf_fsdp2", chunk=chunk)
    liger = [dict(big, name=f"{system} liger", system=system, liger=True) for system in ("hf_fsdp2", "trainer")]
    return [dict(run, kind="switches") for run in (*fp16, chunked, *liger)]


def switched(spec: dict) -> dict:
    """Train one run with its loss scale and skipped steps recorded; a Liger run that cannot run here is skipped."""
    if spec.get("liger"):
        skipped = liger_unavailable(spec["system"])
        if skipped is not None:
            return skipped
    scaling: dict[str, Any] = {"skipped_steps": [], "loss_scales": [], "grad_scaler": False}
    try:
        record = train(spec, callbacks=(scale_probe(scaling),))
    except ValueError as error:
        if not (spec.get("liger") and not on_cuda() and "Liger" in str(error)):
            raise
        return {"status": "skipped: no CUDA", "refused": str(error)[:400]}
    return {**record, **scaling}


def liger_unavailable(system: str) -> dict | None:
    """The record of a Liger run that cannot start here; None where it can, or where FSDP2Trainer must refuse it."""
    if on_cuda():
        for module, wheel in (("liger_kernel", "liger-kernel"), ("triton", "triton")):
            if importlib.util.find_spec(module) is None:
                return {"status": f"skipped: {wheel} not installed", "fix": f"--fetch-wheels brings {LIGER_WHEEL}"}
        return None
    if system == "trainer":
        return {"status": "skipped: no CUDA", "refused": TRAINER_NOT_TRIED}
    return None  # FSDP2Trainer refuses it by name without CUDA: `switched` records that refusal


def scale_probe(record: dict) -> Any:
    """A callback recording after each step whether the gradient scaler skipped it, and the loss scale."""
    from transformers import TrainerCallback

    class ScaleProbe(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):  # noqa: ANN001
            scaler = getattr(optimizer, "scaler", None)  # Accelerate's optimizer wrapper holds the run's scaler
            record["grad_scaler"] = scaler is not None
            if scaler is not None:
                record["loss_scales"].append(float(scaler.get_scale()))
            if getattr(optimizer, "step_was_skipped", False):
                record["skipped_steps"].append(state.global_step)

    return ScaleProbe()


def not_trained(run: dict) -> str | None:
    """Why a run has no figures (skipped, failed, not run), or None when it trained."""
    if not run:
        return "not run"
    if "error" in run:
        return "failed: " + run["error"][:120].replace("|", "/").replace("\n", " ")
    return run.get("status")


def loss_difference(run: dict, reference: dict, relative: float) -> str:
    """The largest loss difference from the reference run, against `relative` x its largest loss."""
    if run is reference:
        return "reference"
    if not_trained(reference) or not reference.get("losses"):
        return ""
    if len(run["losses"]) != len(reference["losses"]):
        return f"not comparable: {len(run['losses'])} steps against {len(reference['losses'])}"
    diff = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"], strict=True))
    tolerance = relative * max(reference["losses"])
    verdict = "within" if diff <= tolerance else "**outside**"
    return f"{diff:.2e} ({verdict} {tolerance:.1e})"


def liger_table(runs: dict, throughput: dict) -> list[str]:
    """Liger's runs, our loss_chunk_size, and part throughput's runs without either, against Trainer + Liger."""
    reference = runs.get("trainer liger", {})
    lines = [
        "",
        "| Liger (1B, 4 x 2048 tokens, bf16) | tokens/s | peak allocated | max loss difference from Trainer + Liger |",
        "|---|---:|---:|---|",
    ]
    rows = [(name, runs.get(name, {})) for name in LIGER_ROWS]
    plain = [name for name in ("hf_fsdp2", "trainer") if name in throughput]
    rows += [(f"{name} (part throughput, no Liger)", throughput[name]) for name in plain]
    for name, run in rows:
        if name == "hf_fsdp2 loss_chunk_size" and "spec" in run:
            name = f"hf_fsdp2 loss_chunk_size={run['spec']['chunk']}"
        reason = not_trained(run)
        if reason is not None:
            lines.append(f"| {name} | {reason} | | |")
            continue
        diff = loss_difference(run, reference, BF16_REL_TOLERANCE)
        lines.append(f"| {name} | {run['tokens_per_s']:,.0f} | {run['train_peak_mib']:,.0f} MiB | {diff} |")
    return lines


def fp16_table(runs: dict) -> list[str]:
    """FSDP2Trainer(fp16=True) against Trainer(fp16=True): skipped steps, loss scale, losses, tokens/s."""
    reference = runs.get("trainer fp16", {})
    lines = [
        "",
        "| fp16 (100M, fp32 weights, 20 steps) | computed in | tokens/s | skipped steps | loss scale | first → last "
        "loss | max loss difference from Trainer |",
        "|---|---|---:|---|---|---|---|",
    ]
    for name in FP16_ROWS:
        run = runs.get(name, {})
        reason = not_trained(run)
        if reason is not None:
            lines.append(f"| {name} | {reason} | | | | | |")
            continue
        computed = "fp16, scaled loss" if run["grad_scaler"] else "fp32 (no scaler, no autocast)"
        steps = run["skipped_steps"]
        skipped = f"{len(steps)} (steps {', '.join(map(str, steps))})" if steps else "0"
        scales = f"{run['loss_scales'][0]:.0f} → {run['loss_scales'][-1]:.0f}" if run["loss_scales"] else ""
        curve = f"{run['losses'][0]:.3f} → {run['losses'][-1]:.3f}"
        diff = loss_difference(run, reference, FP16_REL_TOLERANCE)
        lines.append(f"| {name} | {computed} | {run['tokens_per_s']:,.0f} | {skipped} | {scales} | {curve} | {diff} |")
    return lines


def switches_table(parts: dict) -> list[str]:
    """The part's two tables (none when the part did not run)."""
    runs = parts.get("switches", {}).get("runs", {})
    if not runs:
        return []
    return liger_table(runs, parts.get("throughput", {}).get("runs", {})) + fp16_table(runs)
