"""Three asynchronous saves through one PartSavers, the weights changing while each is written; every rank then
reads each checkpoint back and reports whether it holds exactly the state of its save (tests async saves).

`--self-closing-stager` stands in torch 2.11's DefaultStager, which closes itself after staging (so its second
save used to fail with `KeyError: <class 'type'>`), on whichever torch runs the test.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

import hf_fsdp2.checkpoints.sharded_save as checkpoint
from hf_fsdp2.checkpoints.sharded_save import PartSavers, sharded_parts, wait_for_writes, write_parts
from hf_fsdp2.distributed import close_distributed, init_distributed
from hf_fsdp2.meshes import build_mesh

SAVES = 3


class SelfClosingStager(checkpoint.DefaultStager):
    """torch 2.11's DefaultStager: its stage() ends by closing it (emptying the table its copies dispatch on)."""

    def stage(self, state_dict: dict, **kwargs: Any) -> Any:
        staged = super().stage(state_dict, **kwargs)
        self.close()
        return staged


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A two-layer model sharded over the ranks, with AdamW (its state is the optimizer part)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    mesh = build_mesh()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training step: every weight and optimizer moment changes."""
    model(torch.randn(4, 16)).square().sum().backward()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--self-closing-stager", action="store_true")
    args = parser.parse_args()
    init_distributed()
    if args.self_closing_stager:
        checkpoint.DefaultStager = SelfClosingStager
    model, optimizer = build()
    savers = PartSavers(async_save=True)
    expected = []
    for index in range(SAVES):
        step(model, optimizer)
        parts = sharded_parts(model, optimizer)
        expected.append(local_copies(parts))
        pending = write_parts(os.path.join(args.out, f"save-{index}"), parts, savers)
        step(model, optimizer)  # the weights change while the save is written: it must hold the staged copy
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
    result = {"reuses_stagers": savers.reuses_stagers, "compared": compared, "mismatched": mismatched}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    close_distributed()


if __name__ == "__main__":
    main()
