"""Part "offload": cpu_offload=True against the same run kept on the GPU (issue 63), in one worker, with where each
step's time goes, and AdamW's step on this host's CPU.

Each training run (1B, activation checkpointing) times every step's phases with the GPU synchronised at each mark:
forward + backward (the gradients' copies to the host included: FSDP2 waits for them at the end of backward),
gradient clipping, the optimizer step, and the rest (learning rate, zero_grad). Its last step runs under
torch.profiler, which sums the device time of host-to-device and device-to-host copies and of everything else the GPU
ran; that step is left out of the medians. At world size 1 FSDP2 (torch 2.11-2.13) skips the all-gather and copies
each unit's host shard to the GPU on the compute stream as the unit starts, so nothing overlaps those copies here; at
N ranks they ride the all-gather's streams, prefetched.

Run "host adamw" steps torch's AdamW over sharded fp32 parameters on the host, as cpu_offload does, with each
implementation: fused (Trainer's default optim, 'adamw_torch_fused'), foreach, and the for-loop ('adamw_torch' on CPU
tensors) (scripts/measure/measure_offload_adamw.py). On the CPU rehearsal FSDP2Trainer refuses cpu_offload (no
accelerator): that run records the refusal, the others run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from gpu_parts.common import dry_run
from gpu_parts.training import train

PHASES = ("forward_backward", "clip", "optimizer", "rest")
HOST_ADAMW = "host adamw"
PROFILED = {"h2d": "Memcpy HtoD", "d2h": "Memcpy DtoH"}


def plan_offload(ac: dict, rehearsal: bool) -> list[dict]:
    """The on-GPU reference, the offload run (5 steps: 1 warm-up, 3 timed, 1 profiled), and the host's AdamW."""
    base = dict(ac, steps=5, warmup=1, profile_step=4, kind="offload")
    return [
        dict(base, name="hf_fsdp2 AC"),
        dict(base, name="hf_fsdp2 AC cpu_offload", offload=True),
        dict(name=HOST_ADAMW, kind="host_adamw", params=2e6 if rehearsal else 200e6, rounds=3),
    ]


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def phase_probe(spec: dict, record: dict) -> tuple[Any, Any]:
    """A callback timing each step's phases (and profiling step `profile_step`), and the function that wraps the
    trainer's gradient clipping in a timer."""
    from transformers import TrainerCallback

    marks: dict[str, float] = {}
    record["phases"] = {name: [] for name in PHASES}

    def mark(name: str) -> None:
        sync()
        marks[name] = time.perf_counter()

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            marks.clear()
            marks["clip_s"] = 0.0
            if state.global_step == spec["profile_step"]:
                self.profiler = profiler()
                self.profiler.__enter__()
            mark("begin")

        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
            mark("pre_optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
            mark("optimizer")

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            mark("end")
            phases = {
                "forward_backward": marks["pre_optimizer"] - marks["begin"] - marks["clip_s"],
                "clip": marks["clip_s"],
                "optimizer": marks["optimizer"] - marks["pre_optimizer"],
                "rest": marks["end"] - marks["optimizer"],
            }
            for name, seconds in phases.items():
                record["phases"][name].append(round(seconds, 4))
            if getattr(self, "profiler", None) is not None:
                self.profiler.__exit__(None, None, None)
                record["profiled"] = profiled_times(self.profiler)
                self.profiler = None

    def time_clipping(trainer: Any) -> None:
        clip = trainer._clip_grad_norm

        def timed(model: Any) -> Any:
            sync()
            start = time.perf_counter()
            norm = clip(model)
            sync()
            marks["clip_s"] += time.perf_counter() - start
            return norm

        trainer._clip_grad_norm = timed

    return Phases(), time_clipping


def profiler() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities)


def profiled_times(prof: Any) -> dict[str, float]:
    """Milliseconds of device time in host-to-device and device-to-host copies and in everything else the device
    ran, and of host time in the optimizer's step, over the profiled step."""
    totals = {"h2d": 0.0, "d2h": 0.0, "other_device": 0.0, "optimizer_host": 0.0}
    for event in prof.key_averages():
        device = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0
        kind = next((k for k, label in PROFILED.items() if label in event.key), None)
        if device:
            totals[kind or "other_device"] += device / 1e3
        if event.key.startswith("Optimizer.step#"):
            totals["optimizer_host"] += event.cpu_time_total / 1e3
    return {k: round(v, 1) for k, v in totals.items()}


def offload_run(spec: dict) -> dict:
    """Train one run with its phases timed and its last step profiled; the medians leave the profiled step out."""
    record: dict[str, Any] = {}
    callback, time_clipping = phase_probe(spec, record)
    record |= train(spec, callbacks=(callback,), built=time_clipping)
    timed = slice(spec["warmup"], spec["profile_step"])
    record["step_median_s"] = round(statistics.median(record["step_s"][timed]), 4)
    record["tokens_per_s"] = round(spec["batch"] * spec["seq"] / record["step_median_s"], 1)
    record["phase_median_s"] = {k: round(statistics.median(v[timed]), 4) for k, v in record["phases"].items()}
    return record


def host_adamw(spec: dict) -> dict:
    """AdamW's step on this host over `params` sharded fp32 parameters: fused, foreach, for-loop."""
    import torch
    import torch.distributed as dist
    from measure_offload_adamw import measure, sharded_parameters

    from hf_fsdp2.distributed import init_distributed

    init_distributed()  # the worker's group, if a training run has not started it already
    params = sharded_parameters(spec["params"], 64 if dry_run() else 2048)
    seconds = measure(params, spec["rounds"])
    total = sum(p.numel() for p in params)
    rows = {
        name: {"step_median_s": round(statistics.median(t), 4), "min_s": round(min(t), 4)}
        for name, t in seconds.items()
    }
    for row in rows.values():
        row["gparams_per_s"] = round(total / row["step_median_s"] / 1e9, 2)
    del params
    return {
        "params": total,
        "threads": torch.get_num_threads(),
        "world": dist.get_world_size(),
        "implementations": rows,
    }


def offload_table(parts: dict) -> list[str]:
    """The training runs' figures, where their steps' time went, and the host's AdamW (none when the part did not
    run; records before issue 63 have only the first table)."""
    runs = parts.get("offload", {}).get("runs", {})
    trained = {name: run for name, run in runs.items() if name != HOST_ADAMW}
    if not runs:
        return []
    keys = ["train_peak_mib", "step_median_s", "tokens_per_s"]
    lines = ["", "| offload | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, run in trained.items():
        lines.append(f"| {name} | " + " | ".join(f"{run[k]:,}" if k in run else "failed" for k in keys) + " |")
    return lines + phases_table(trained) + host_adamw_table(runs.get(HOST_ADAMW, {}))


def phases_table(runs: dict) -> list[str]:
    """Median seconds of each phase per step, the profiled step's copies (device ms), and offload's tokens/s against
    the on-GPU run's."""
    timed = {name: run for name, run in runs.items() if "phase_median_s" in run}
    if not timed:
        return []
    reference = timed.get("hf_fsdp2 AC", {})
    lines = [
        "",
        "| where a step goes (s, median) | step | forward + backward | clip | optimizer step | rest | H2D copies "
        "| D2H copies | other GPU work | tokens/s ÷ on the GPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in timed.items():
        phases, copies = run["phase_median_s"], run.get("profiled", {})
        ms = [f"{copies[k] / 1e3:.3f}" if k in copies else "" for k in ("h2d", "d2h", "other_device")]
        ratio = f"{run['tokens_per_s'] / reference['tokens_per_s']:.2f}×" if "tokens_per_s" in reference else ""
        cells = [f"{run['step_median_s']:.3f}", *(f"{phases[k]:.3f}" for k in PHASES), *ms, ratio]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def host_adamw_table(run: dict) -> list[str]:
    if "implementations" not in run:
        return [] if not run else ["", f"| host AdamW | failed: {run.get('error', '')[:100]} |", "|---|---|"]
    lines = [
        "",
        f"| AdamW on the host ({run['params'] / 1e6:,.0f}M fp32 params, {run['threads']} threads) | step (median) "
        "| G params/s |",
        "|---|---:|---:|",
    ]
    for name, row in run["implementations"].items():
        lines.append(f"| {name} | {row['step_median_s']:.3f} s | {row['gparams_per_s']:.2f} |")
    return lines
