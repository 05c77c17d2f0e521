"""Three asynchronous saves through one PartSavers, each followed by the next step as the trainer runs it: the forward
and backward while the state is copied to host memory (`--slow-staging` makes the copy slower than they are), the
wait for the copy, then the optimizer step while the save is written. Every rank then reads each checkpoint back and
reports whether it holds exactly the state of its save, and whether every save after the first copied into the host
buffers of the one before (tests async saves: tests/test_checkpoint.py).

The model has a BatchNorm, whose running statistics (buffers, not sharded) a forward updates while the copy runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

from hf_fsdp2.checkpoints.sharded_save import (
    HostStager,
    PartSavers,
    sharded_parts,
    wait_for_staging,
    wait_for_writes,
    write_parts,
)
from hf_fsdp2.distributed import close_distributed, init_distributed
from hf_fsdp2.meshes import build_mesh

SAVES = 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two linear layers and a BatchNorm sharded over the ranks, with AdamW (its state is the optimizer part)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    mesh = build_mesh()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def forward_backward(model: torch.nn.Module) -> None:
    """The part of a step that changes no weight and no optimizer state (it does update BatchNorm's statistics)."""
    model(torch.randn(4, 16)).square().sum().backward()


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad()


def local_copies(parts: list) -> dict[str, torch.Tensor]:
    """This rank's tensors of `parts`, cloned, by folder and flattened key."""
    flat = {}
    for folder, state in parts:
        for key, value in flatten(state).items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                flat[f"{folder}/{key}"] = local.detach().clone()
    return flat


def flatten(state: dict, prefix: str = "") -> dict:
    """`state`'s leaves by dotted key."""
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def slow_staging(seconds: float) -> None:
    """Make every host copy start `seconds` late, so the step after a save finishes its forward and backward first."""
    copy = HostStager._copy

    def late(self: HostStager, *args: Any) -> Any:
        time.sleep(seconds)
        return copy(self, *args)

    HostStager._copy = late


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--slow-staging", type=float, default=0.0)
    args = parser.parse_args()
    init_distributed()
    if args.slow_staging:
        slow_staging(args.slow_staging)
    model, optimizer = build()
    savers = PartSavers(async_save=True)
    expected, reused, pending = [], [], []
    forward_backward(model)
    optimizer_step(optimizer)
    for index in range(SAVES):
        error = wait_for_writes(pending)  # the trainer's next save waits for the last one's writes
        if error is not None:
            raise error
        parts = sharded_parts(model, optimizer)
        expected.append(local_copies(parts))
        pending = write_parts(os.path.join(args.out, f"save-{index}"), parts, savers)
        forward_backward(model)  # the next step, while the state is copied
        error = wait_for_staging(pending)  # what the trainer's on_pre_optimizer_step does
        if error is not None:
            raise error
        reused.append(savers.buffers_reused())
        optimizer_step(optimizer)  # while the save is written: it must hold the copy
    error = wait_for_writes(pending)
    if error is not None:
        raise error
    savers.close()
    mismatched, compared = [], 0
    for index in range(SAVES):
        parts = sharded_parts(model, optimizer)
        for folder, state in parts:
            dcp.load(state, checkpoint_id=os.path.join(args.out, f"save-{index}", folder))
        for key, value in local_copies(parts).items():
            compared += 1
            if not torch.equal(value, expected[index][key]):
                mismatched.append(f"save {index}: {key}")
    result = {"buffers_reused": reused, "compared": compared, "mismatched": mismatched}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    close_distributed()


if __name__ == "__main__":
    main()
