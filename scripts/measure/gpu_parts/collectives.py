"""Part "collectives": every collective path of the package in a group of one, none skipped
(scripts/measure/collective_paths.py), so NCCL gets every tensor a job of N GPUs hands it."""

from __future__ import annotations

from typing import Any


def collectives(spec: dict) -> dict:
    """Every collective path of the package in this world (of one), none skipped; an error names the failing ones."""
    import collective_paths

    from hf_fsdp2.distributed import init_distributed

    init_distributed()
    import torch.distributed as dist

    record: dict[str, Any] = {"backend": str(dist.get_backend()), "paths": collective_paths.run_paths()}
    failed = {k: v for k, v in record["paths"].items() if v != "ok" and not v.startswith("skipped")}
    if failed:
        record["error"] = f"{len(failed)} path(s) failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
    return record


def collectives_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("collective paths", {})
    if not run or "paths" not in run:
        return []
    lines = ["", f"| collective path (world of one, {run['backend']}, no shortcut) | outcome |", "|---|---|"]
    return lines + [f"| {name} | {outcome[:120]} |" for name, outcome in run["paths"].items()]
