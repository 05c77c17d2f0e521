"""prepare_model: the load → shard pipeline in one call, for the trainer and for scripts.

It composes `sharding` (how units are built) with `loading` (where weights come from) and adds the
gradient helpers a sharded model needs; it knows nothing about the Trainer.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import FSDP2Config
from .distributed import build_mesh, check_same_on_all_ranks, get_device, init_distributed, log_rank0
from .loading import load_sharded
from .sharding import mixed_precision_policy, select_units, shard_model, upcast_trainable


def prepare_model(model: nn.Module, config: FSDP2Config, bf16: bool = False, fp16: bool = False) -> nn.Module:
    """Shard `model` (a meta skeleton or an object with weights) and load every rank's part of its weights."""
    init_distributed()
    check_same_on_all_ranks("FSDP2Config", config.to_summary())
    if config.cpu_offload and get_device().type == "cpu":
        raise ValueError(
            "cpu_offload=True moves shards from an accelerator to host memory, but this machine has no "
            "accelerator (parameters already live in host memory); remove cpu_offload."
        )
    mesh = build_mesh(config.hsdp_replicate_size)
    policy = mixed_precision_policy(config, bf16=bf16, fp16=fp16)
    units = select_units(model, config)

    def shard(skeleton: nn.Module) -> None:
        upcast_trainable(skeleton, policy)
        shard_model(skeleton, mesh, config, policy, units)

    model = load_sharded(model, shard, offload=config.cpu_offload)
    log_rank0(
        "Sharded %s into %d units + root over mesh %s (%s parameters).",
        type(model).__name__,
        len(units),
        tuple(mesh.shape),
        f"{sum(p.numel() for p in model.parameters()):,}",
    )
    return model


@torch.no_grad()
def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Return the global gradient norm over all ranks and clip to `max_norm` (inf: only measure)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        # NOTE: the norm of sharded gradients is a partial sum until reduced across the mesh.
        total = total.full_tensor()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return total
