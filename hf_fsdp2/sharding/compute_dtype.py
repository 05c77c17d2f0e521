"""A sharded model's forwards in another compute dtype for a while (evaluation in bf16 or fp16), with the sharded
parameters (the optimizer's fp32 masters) left exactly as they are: `with computing_in(model, torch.bfloat16): ...`.

Trainer's `bf16_full_eval` casts the model itself, masters included. Here each FSDP unit's MixedPrecisionPolicy is
switched instead: inside the block every unit gathers its parameters in `dtype` and casts floating inputs to it, so
the forwards compute as the cast model would, without a shard being written; after the block the policy is put back.
Unlike `model.to(dtype)`, buffers (RoPE's `inv_freq`) and the 0-dim parameters `fully_shard` leaves whole keep their
dtype. It knows FSDP2's units, not the Trainer.

NOTE: FSDP2 makes a unit's all-gather outputs and unsharded parameters once, at its first all-gather, in the dtype of
that moment; switching (with every unit resharded) drops them so the next all-gather makes them in the new dtype. These
are torch 2.13's private fields (`FSDPParam.all_gather_outputs`, `_unsharded_param`, the state's `_mp_policy`, the
group's `mp_policy` and `_init_mp_dtypes`), as `gathering.py` reads others; torch is pinned below 2.16.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from .gathering import param_groups
from .units import reshard_all


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Inside the block, every FSDP unit of `model` computes in `dtype` (None, or the dtype it computes in already:
    nothing changes). The shards are never written.

    Collective only through the forwards run inside (each rank must run the same ones, as always).
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [unit._get_fsdp_state()._mp_policy for unit in units]
    if dtype is None or all(_computes_in(unit, policy) == dtype for unit, policy in zip(units, saved, strict=True)):
        yield
        return
    reshard_all(model)  # a no-grad forward leaves the root gathered (in the old dtype)
    for unit, policy in zip(units, saved, strict=True):
        _set_policy(unit, dataclasses.replace(policy, param_dtype=dtype))
    try:
        yield
    finally:
        reshard_all(model)
        for unit, policy in zip(units, saved, strict=True):
            _set_policy(unit, policy)


def _computes_in(unit: FSDPModule, policy: MixedPrecisionPolicy) -> torch.dtype | None:
    """The dtype a unit computes in: its policy's param_dtype, else its parameters' own (None: it has none)."""
    if policy.param_dtype is not None:
        return policy.param_dtype
    return next((p.dtype for p in unit.parameters()), None)


def _set_policy(unit: FSDPModule, policy: MixedPrecisionPolicy) -> None:
    """Give a (resharded) unit another MixedPrecisionPolicy: its input cast, its parameters' compute dtype, and the
    gathered buffers made afresh at the next all-gather."""
    state = unit._get_fsdp_state()
    state._mp_policy = policy
    for group in param_groups(state):
        group.mp_policy = policy
        group._init_mp_dtypes()  # each FSDPParam's param_dtype (None when it equals the parameter's own)
        for fsdp_param in group.fsdp_params:
            _forget_gathered(fsdp_param)


def _forget_gathered(fsdp_param: Any) -> None:
    """Drop the all-gather outputs and the unsharded parameter FSDP2 made (freed already: the unit is resharded)."""
    fsdp_param.all_gather_outputs = []
    if hasattr(fsdp_param, "_unsharded_inner_tensors"):
        fsdp_param._unsharded_inner_tensors = []
    if hasattr(fsdp_param, "_unsharded_param"):
        del fsdp_param._unsharded_param
