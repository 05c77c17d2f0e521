"""Every rank trains a step with FSDP2 and DDP, closes the group, and says what it saw (tests close_distributed).

FSDP2 (through DTensor's caches) and DDP are what used to keep a destroyed gloo group and its threads alive.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from hf_fsdp2 import close_distributed
from hf_fsdp2.distributed import get_device, init_distributed
from hf_fsdp2.meshes import build_mesh


def gloo_threads() -> int:
    """Threads of gloo process groups still running in this process (Linux names them in /proc)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith(("pt_gloo", "gloo_"))
        except FileNotFoundError:  # the thread ended while we looked
            pass
    return count


def train_a_step() -> float:
    """One FSDP2 step, one DDP step and a DTensor gather: every path that touches the group's caches."""
    torch.manual_seed(0)
    device = get_device()  # NOTE: the job's groups take the accelerator's tensors on GPUs
    sharded = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mesh = build_mesh()
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded(torch.ones(2, 8, device=device)).sum().backward()
    replicated = DistributedDataParallel(torch.nn.Linear(8, 8).to(device))
    replicated(torch.ones(2, 8, device=device)).sum().backward()
    return sharded[0].weight.full_tensor().sum().item()


def main() -> None:
    init_distributed()
    total = torch.tensor([dist.get_rank() + 1.0], device=get_device())
    dist.all_reduce(total)
    train_a_step()
    threads_before = gloo_threads()
    close_distributed()
    open_after_close = dist.is_initialized()
    close_distributed()  # a second call (or one without a group) is a no-op
    print(
        f"rank {os.environ.get('RANK', '0')}: sum {total.item():g}, open after close {open_after_close}, "
        f"gloo threads {threads_before} before close, {gloo_threads()} after",
        flush=True,
    )


if __name__ == "__main__":
    main()
