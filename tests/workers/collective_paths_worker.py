"""Every collective path of the package (scripts/measure/collective_paths.py) under the device audit.

Usage: collective_paths_worker.py OUT. Rank 0 writes OUT/world<N>.json: for each path its outcome, how many
collectives it made and the audit's violations; plus a planted path (Muon's first owner-failure agreement: a flag
made without a device, all-reduced over the shard group) that the audit must flag.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_fsdp2 import distributed
from hf_fsdp2.meshes import build_mesh
from tests.collective_audit import audited

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "measure"))
import collective_paths  # noqa: E402

OUT = sys.argv[1]


def planted() -> None:
    """The bug the audit exists for: hf_fsdp2 0.1's Muon agreement (CPU flag, the mesh's shard group)."""
    group = build_mesh().get_group()
    flag = torch.tensor([0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)


def main() -> None:
    distributed.init_distributed()
    collective_paths.PATHS["planted_cpu_flag"] = planted
    report = {}
    for name in collective_paths.PATHS:
        with audited() as audit:
            outcome = collective_paths.run_paths([name])[name]
        report[name] = {"outcome": outcome, "calls": len(audit.calls), "violations": audit.violations}
    if distributed.is_rank0():
        with open(os.path.join(OUT, f"world{dist.get_world_size()}.json"), "w") as f:
            json.dump(report, f, indent=1)


main()
