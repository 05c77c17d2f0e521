"""Part "two_ranks": real jobs at 2 ranks sharing the one lent GPU, each held against the same job in one process.

NCCL refuses two ranks on one GPU; `torchrun --nproc_per_node 2 -m hf_fsdp2.shared_device` starts the job's group as
gloo registered for CUDA only, which routes tensors as NCCL does and really exchanges them (hf_fsdp2/shared_device.py),
so the collectives a world of one skips run here. The driver launches the one-process runs first (one plain process,
every job in turn), then the 2-rank runs (one torchrun launch); at 2 ranks rank 0 compares each job, as it ends, with
the record its one-process run left. The jobs are in gpu_parts/two_ranks_jobs.py and gpu_parts/two_ranks_trl.py.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from gpu_parts.common import BF16_REL_TOLERANCE, FP32_TOLERANCE
from gpu_parts.two_ranks_jobs import (
    adafactor,
    build_models,
    lora,
    muon,
    offload,
    offload_control,
    qlora,
    rank,
    save_resume_consolidate,
    sequence_parallel,
    trained,
    world,
)
from gpu_parts.two_ranks_trl import dpo, grpo

# In the order the 2-rank launch runs them. Last, the two that may break the group on a GPU, so that they cost no other
# job: the control (torch's own mesh on the default group: its failure is the point), and DPO, whose dataset
# preparation waits in Accelerate's `wait_for_everyone`, a barrier on device LOCAL_RANK (hf_fsdp2.shared_device sets
# LOCAL_RANK to the shared device's index for that reason; not yet run on a GPU).
JOBS: dict[str, Callable[[str], dict]] = {
    "full fp32": trained,
    "full bf16": lambda name: trained(name, args=dict(bf16=True)),
    "lora": lora,
    "qlora": qlora,
    "cpu offload": offload,
    "muon": muon,
    "adafactor": adafactor,
    "sequence parallel": sequence_parallel,
    "grpo reward model": grpo,
    "save resume consolidate": save_resume_consolidate,
    "cpu offload control": offload_control,
    "dpo": dpo,
}
TWO_RANKS_ONLY = ("cpu offload control",)  # at one rank FSDP2 skips the collective it shows failing
ONE_PROCESS = " (one process)"  # the name suffix of a job's one-process run
# The one-process runs' records, in the workdir: the driver's name for system "one_process" of this part.
REFERENCES = "out-two_ranks-one_process.jsonl"
# How long rank 0 waits after a job for the other rank to end it too; past it, a rank is stuck in a collective.
SETTLE_TIMEOUT = timedelta(seconds=60)


def plan_two_ranks() -> list[dict]:
    """The runs of the part: every job in one process, then every job at 2 ranks (run by the driver in this order)."""
    runs = [
        dict(name=job + ONE_PROCESS, job=job, system="one_process", kind="two_ranks")
        for job in JOBS
        if job not in TWO_RANKS_ONLY
    ]
    return runs + [dict(name=job, job=job, system="two_ranks", kind="two_ranks") for job in JOBS]


def two_ranks(spec: dict) -> dict:
    """Run one job in this world; at 2 ranks, rank 0's record is its verdict against the one-process run."""
    if world() == 1:
        build_models()
        return JOBS[spec["job"]](spec["job"])
    group = host_group()
    if rank() == 0:
        build_models()  # NOTE: built by the one-process launch already, unless that launch failed first
    settle(group, None)
    try:
        ours, error = JOBS[spec["job"]](spec["job"]), None
    except Exception as failure:  # noqa: BLE001 - recorded with the other rank's outcome; the next job still runs
        traceback.print_exc()
        ours, error = {}, f"{type(failure).__name__}: {failure}"[-2000:]
    errors = settle(group, error)
    import torch.distributed as dist

    record: dict[str, Any] = {"backend": str(dist.get_backend()), "world": world()}
    if errors is None:  # NOTE: the driver's worker writes this record from whichever rank saw it, then ends
        waited = f"waited {SETTLE_TIMEOUT.total_seconds():.0f} s for the other rank to end the job"
        why = f"rank {rank()}: {error or 'ended the job'}; {waited}: the group is broken, the launch ends here"
        return record | {"status": "failed", "error": why, "group_broken": True}
    if rank() != 0:
        return record  # rank 0 writes the job's record
    if any(errors):
        return record | {"status": "failed", "error": "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)}
    return record | verdict(spec["job"], ours, reference(spec["job"]))


_host_group: Any = None


def host_group() -> Any:
    """A gloo group over both ranks for the jobs' bookkeeping, apart from the groups the jobs use (NOTE: collective:
    both ranks create it at their first job)."""
    global _host_group
    if _host_group is None:
        from hf_fsdp2.distributed import init_distributed, new_host_group

        init_distributed()
        _host_group = new_host_group()
    return _host_group


def settle(group: Any, error: str | None) -> list[str | None] | None:
    """Wait for every rank to end the job, then share what each raised; None when a rank did not come within
    SETTLE_TIMEOUT: it is stuck in a collective the other left, so the job's group is broken."""
    import torch.distributed as dist

    try:
        # NOTE: not monitored_barrier: there only rank 0 times out, and a rank 1 waiting for a stuck rank 0 never would.
        dist.barrier(group=group, async_op=True).wait(timeout=SETTLE_TIMEOUT)
    except RuntimeError:
        traceback.print_exc()
        return None
    errors: list[str | None] = [None] * world()
    dist.all_gather_object(errors, error, group=group)
    return errors


def reference(job: str) -> dict | None:
    """The record the job's one-process run left (None when that run never ended)."""
    path = os.path.join(os.environ["GPU_CHECK_WORKDIR"], REFERENCES)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return next((r for r in records if r["name"] == job + ONE_PROCESS), None)


def verdict(job: str, ours: dict, theirs: dict | None) -> dict:
    """The job at 2 ranks against one process: the largest difference of each compared series and of the weights,
    each against its tolerance, and the jobs' own checks (both runs')."""
    if "status" in ours:  # skipped, or the control's outcome: nothing to compare
        return ours
    if theirs is None or "error" in theirs or "status" in theirs:
        why = "never ended" if theirs is None else theirs.get("error") or theirs["status"]
        return {"status": "failed", "error": f"the one-process run: {why}"[:2000]}
    diffs, scales = {}, {}
    for key, values in ours["compared"].items():
        wanted = theirs["compared"][key]
        if len(values) != len(wanted):
            return {"status": "failed", "error": f"{key}: {len(values)} values against {len(wanted)} in one process"}
        diffs[key] = max((abs(a - b) for a, b in zip(values, wanted, strict=True)), default=0.0)
        scales[key] = max((abs(b) for b in wanted), default=0.0)
    for label, path in ours.get("weight_files", {}).items():
        key = "weights" if label == "final" else f"weights ({label})"
        diffs[key], scales[key] = weight_difference(path, theirs["weight_files"]["final"])
    bf16 = job == "full bf16"  # NOTE: relative there: 2% of the largest loss, of the largest weight
    tolerance = {k: BF16_REL_TOLERANCE * scales[k] if bf16 else FP32_TOLERANCE for k in diffs}
    checks = {**{f"one process: {k}": ok for k, ok in theirs.get("checks", {}).items()}, **ours.get("checks", {})}
    problems = [f"{k} differ by {d:.2e} > {tolerance[k]:.1e}" for k, d in diffs.items() if not d <= tolerance[k]]
    problems += [f"check failed: {name}" for name, ok in checks.items() if not ok]
    record = {"diffs": diffs, "tolerance": tolerance, "checks": checks}
    record |= {"losses": ours["compared"].get("losses"), "one_process_losses": theirs["compared"].get("losses")}
    if problems:
        return record | {"status": "failed", "error": "; ".join(problems)}
    return record | {"status": "ok"}


def weight_difference(ours: str, theirs: str) -> tuple[float, float]:
    """The largest difference between two weights files (the same names), and the largest weight of `theirs`."""
    import torch

    a, b = torch.load(ours), torch.load(theirs)
    if a.keys() != b.keys():
        raise ValueError(f"weights differ in names: {sorted(set(a) ^ set(b))[:5]}")
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    return diff, max(float(v.abs().max()) for v in b.values())


def two_ranks_table(part: dict) -> list[str]:
    """One row per job: its largest differences at 2 ranks from one process, their tolerance, the outcome."""
    runs = {name: run for name, run in part.get("runs", {}).items() if not name.endswith(ONE_PROCESS)}
    if not runs:
        return []
    backend = next((run["backend"] for run in runs.values() if "backend" in run), "?")
    lines = [
        "",
        f"| job (2 ranks on {backend}) | 2 ranks (one GPU) vs one process | tolerance | outcome |",
        "|---|---|---|---|",
    ]
    for name, run in runs.items():
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in run.get("diffs", {}).items())
        tolerances = sorted({f"{v:.0e}" for v in run.get("tolerance", {}).values()})
        if len(tolerances) > 1:
            tolerances = [", ".join(f"{k} {v:.1e}" for k, v in run["tolerance"].items())]
        outcome = run.get("status", "failed")
        if run.get("error", "").startswith("worker ended before this run"):  # the log's tail is in the results file
            outcome = "not run: the launch ended before it"
        elif "error" in run:
            outcome = f"{outcome}: {run['error'][:160]}"
        elif "control_error" in run:
            outcome = f"{outcome}: {run['control_error'][:120]}"
        cells = [name, diffs, ", ".join(tolerances), outcome.replace("|", "/").replace("\n", " ")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
