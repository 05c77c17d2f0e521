"""Train a tiny Llama sharded with the pooled CPU comms and again with FSDP2's defaults; record both.

Usage: comm_buffers_worker.py OUT. Rank 0 writes OUT/result.json: both runs' losses, whether every final weight is
bitwise equal, and how many buffers the pool held after each step.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.sharding.comm_buffers import BufferPool, PooledAllGather
from hf_fsdp2.sharding.gathering import param_groups
from hf_fsdp2.sharding.units import shard_model
from tests.tiny_models import VOCAB, llama

STEPS = 4


def build(pooled: bool) -> tuple[torch.nn.Module, BufferPool | None]:
    """A seeded tiny Llama sharded by hf_fsdp2; `pooled=False` puts FSDP2's default comms back."""
    torch.manual_seed(0)
    model = llama(layers=3)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard_model(model, mesh, FSDP2Config(), MixedPrecisionPolicy())
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not pooled:
        for module in modules:
            module.set_custom_all_gather(DefaultAllGather())
            module.set_custom_reduce_scatter(DefaultReduceScatter())
        return model, None
    comm = param_groups(modules[0]._get_fsdp_state())[0]._all_gather_comm  # torch 2.11 and 2.13 alike
    assert isinstance(comm, PooledAllGather), f"shard_model on a CPU mesh left {type(comm).__name__}"
    return model, comm.pool


def train(pooled: bool) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    """Losses, full final weights and the pool's buffer count after each step."""
    model, pool = build(pooled)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses, held = [], []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (2, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        held.append(pool.count() if pool else 0)
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return losses, weights, held


def main() -> None:
    dist.init_process_group("gloo")
    pooled_losses, pooled_weights, held = train(pooled=True)
    default_losses, default_weights, _ = train(pooled=False)
    if dist.get_rank() == 0:
        same = all(torch.equal(pooled_weights[k], default_weights[k]) for k in default_weights)
        result = dict(pooled=pooled_losses, default=default_losses, same_weights=same, held=held)
        os.makedirs(sys.argv[1], exist_ok=True)
        with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
