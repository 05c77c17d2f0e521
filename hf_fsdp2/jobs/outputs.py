"""What a job leaves behind and prints: the summary JSON, the training-curves PNG, peak memory per rank,
and the few-line summary. Shared by every job; knows nothing about what a job trains.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging

from .charts import line_chart_png

logger = logging.get_logger(__name__)

CURVES_FILE = "training_curves.png"
SUMMARY_FILE = "job_summary.json"


def peak_memory_per_rank() -> list[dict[str, float]]:
    """Peak host RSS (VmHWM) and, on CUDA, peak allocated accelerator memory of every rank, in MiB."""
    mine = {"host_mib": _vm_hwm_kib() / 1024}
    if torch.cuda.is_available():
        mine["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def write_outputs(
    summary: dict[str, Any], history: list[dict[str, Any]], output_dir: str, curves: dict[str, str]
) -> dict:
    """Rank 0: write the summary JSON and a PNG of the logged `curves` (panel title → log key); return them."""
    points = {title: [(h["step"], h[key]) for h in history if key in h] for title, key in curves.items()}
    if any(points.values()):
        try:
            line_chart_png(points, os.path.join(output_dir, CURVES_FILE))
        except ImportError as error:  # the chart is a bonus: the job's results are in the summary either way
            logger.warning("No %s: %s", CURVES_FILE, error)
    with open(os.path.join(output_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    return points


def render_summary(
    summary: dict[str, Any], output_dir: str, curves: dict[str, list], title: str, metrics: tuple[str, ...]
) -> str:
    """A job's result in a few lines: `metrics` before/after, the reloaded export's score, examples, memory."""
    before, after = summary.get("before", {}), summary.get("after", {})
    width = max(len(key) for key in (*metrics, "reloaded"))
    lines = ["", f"=== hf_fsdp2 {title} summary ==="]
    for key in metrics:
        if key in before:
            lines.append(f"{key:>{width}}: {before[key]:.4f} before → {after[key]:.4f} after training")
    for key, score in summary.get("reloaded", {}).items():
        if key != "examples":
            lines.append(f"{'reloaded':>{width}}: {key} {score:.4f} from {output_dir}")
    for example in after.get("examples", []):
        lines.append(f"  {example['prompt']!r} → {example['generated']!r} (expected {example['expected']!r})")
    memory = ", ".join(
        f"rank {r}: {m['host_mib']:.0f} MiB" + (f" host, {m['cuda_mib']:.0f} MiB GPU" if "cuda_mib" in m else "")
        for r, m in enumerate(summary["peak_memory_mib_per_rank"])
    )
    lines.append(f"peak memory: {memory}")
    panels = " / ".join(name for name, points in curves.items() if points)
    lines.append(
        f"outputs: {output_dir} (model, checkpoint-*/, {SUMMARY_FILE}, {CURVES_FILE}: {panels}, top to bottom)"
    )
    return "\n".join(lines)
