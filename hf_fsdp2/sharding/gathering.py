"""Inference on a sharded model with each unit gathered once: `with hf_fsdp2.gathered(model): model.generate(...)`.

Under FSDP2 every forward all-gathers each unit's parameters and frees them after; `generate` runs one forward
per new token, so a 32-token generation gathers the whole model 32 times. Inside `gathered`, every unit is
all-gathered once (in the compute dtype of its MixedPrecisionPolicy) and kept until the block ends, then
resharded; the reshard-after-forward settings are put back exactly as they were, and nothing else (gradients,
optimizer, prefetching) is touched. It holds the whole model in the compute dtype on each rank for the block.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..adapters.nf4 import NF4_BYTES_PER_ELEMENT, is_nf4
from .inference_mode import outside_inference_mode


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Gather every FSDP unit of `model` once, keep it gathered inside the block, reshard after.

    Collective: every rank must enter it (and run the same forwards inside). A model that is not sharded, or a
    block already inside `gathered`, passes through unchanged.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units or getattr(model, _ACTIVE, False):
        yield model
        return
    saved = [_reshard_setting(unit) for unit in units]
    setattr(model, _ACTIVE, True)
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        # NOTE: one unit at a time: issuing every all-gather first (async) was no faster over gloo (measured) and
        # holds every unit's all-gather buffer beside the gathered parameters.
        with outside_inference_mode():  # the gathered buffers outlive the block (inference_mode.py)
            for unit in units:
                unit.unshard()
        yield model
    finally:
        with outside_inference_mode():
            for unit, setting in zip(units, saved, strict=True):
                unit.reshard()
                _restore_reshard_setting(unit, setting)
        setattr(model, _ACTIVE, False)


_ACTIVE = "_hf_fsdp2_gathered"


def param_groups(state: Any) -> list[Any]:
    """A unit's FSDP parameter groups: a list from torch 2.13, one group or None before (the GPU image's 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [group for group in [getattr(state, "_fsdp_param_group", None)] if group is not None]


def gathered_bytes(model: nn.Module) -> int:
    """Bytes the gathered model adds on this rank: every sharded parameter whole, in its unit's compute dtype.

    The shards stay allocated beside it (they are the optimizer's parameters), so nothing is subtracted.
    """
    total = 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in param_groups(unit._get_fsdp_state()):
            for fsdp_param in group.fsdp_params:
                shard = fsdp_param.sharded_param
                local = getattr(shard, "_local_tensor", shard)  # a DTensor's numel is the whole tensor's
                # NF4 bases are gathered in 4 bits (their codes and scalers); dtypes are set at the first forward.
                per_value = NF4_BYTES_PER_ELEMENT if is_nf4(local) else _compute_dtype(fsdp_param, local).itemsize
                total += int(fsdp_param._orig_size.numel() * per_value)
    return total


def _compute_dtype(fsdp_param: Any, shard: torch.Tensor) -> torch.dtype:
    """The dtype a parameter is gathered in (its MixedPrecisionPolicy's param_dtype, else its own)."""
    return getattr(fsdp_param, "param_dtype", None) or getattr(fsdp_param, "orig_dtype", None) or shard.dtype


def free_memory() -> int:
    """Bytes this rank can still allocate: the accelerator's free memory, or its share of the host's available RAM."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        available = int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _reshard_setting(unit: FSDPModule) -> tuple[Any, list[Any]]:
    """What `set_reshard_after_forward` overwrites (torch 2.13's fields, restored as they were)."""
    state = unit._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in param_groups(state)]


def _restore_reshard_setting(unit: FSDPModule, setting: tuple[Any, list[Any]]) -> None:
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward, infos = setting
    for group, info in zip(param_groups(state), infos, strict=True):
        group.post_forward_mesh_info = info
