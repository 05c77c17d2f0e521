"""Tensors on the wrong device for a GPU job, planted in collectives, for the launcher's audit to catch.

Usage: planted_collectives_worker.py CASE... Runs each case on every rank, then exits normally; under
tests/launch.py the audit turns what it found into a failed rank (exit code 3, the violations on stderr). Cases:
- planted_agree: `hf_fsdp2.distributed.agree`'s body replaced by one that makes its flag without a device, reached
  through a package path (BranchGuard's step check);
- object_payload: a tensor made on this rank's device sent through `all_gather_object`;
- chunked: a piece of `.chunk()` of a tensor made without a device, all-reduced over the shard mesh;
- moved_to_cpu: a tensor made on this rank's device, then `.to("cpu")`, all-reduced;
- allowed: what the audit must let through (a device chosen, `.cpu()` rows in an object payload, a CPU tensor on
  a host group, a marked tensor moved to this rank's device).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_fsdp2 import distributed
from hf_fsdp2.distributed import get_device
from hf_fsdp2.meshes import build_mesh


def _planted_agree(values: Sequence[float], op: str, group: Any = None) -> list[float]:
    """agree as a careless edit would write it: the flag left on the default device."""
    flags = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(flags, group=group)
    return flags.tolist()


def planted_agree() -> None:
    from hf_fsdp2.loading.branches import BranchGuard

    # NOTE: the code object, not the module attribute: modules that imported `agree` by name run the plant too.
    original = distributed.agree.__code__
    distributed.agree.__code__ = _planted_agree.__code__
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(get_device())
        guard = BranchGuard(model, ["0"], None)
        model(torch.randn(2, 4, device=get_device())).sum().backward()
        guard.before_optimizer_step()
    finally:
        distributed.agree.__code__ = original


def object_payload() -> None:
    count = torch.tensor(7, device=get_device())  # Trainer's num_items_in_batch is such a tensor
    distributed.first_on_any_rank(count)


def chunked() -> None:
    flags = torch.zeros(4).chunk(2)[1]
    dist.all_reduce(flags, group=build_mesh().get_group())


def moved_to_cpu() -> None:
    total = torch.ones(2, device=get_device()).to("cpu")
    dist.all_reduce(total)


def allowed() -> None:
    device = get_device()
    dist.all_reduce(torch.ones(2, device=device).chunk(2)[0])
    dist.all_reduce(torch.zeros(3).to(device))
    rows = torch.arange(6, device=device).reshape(2, 3)
    distributed.first_on_any_rank({"input_ids": rows.cpu(), "count": int(rows.numel())})
    host = distributed.new_host_group()
    dist.all_reduce(torch.tensor([1.0]), group=host)
    distributed.close_host_group(host)


def main() -> None:
    distributed.init_distributed()
    for case in sys.argv[1:]:
        globals()[case]()
    dist.barrier()


main()
