"""Getting weights into a sharded model without any rank holding more than it must: choose the route, shard,
fill every rank's shards, verify.

Two routes, chosen per model on all ranks together:
- safetensors on every rank (`loading.safetensors_route`): each rank reads only its own slices (torch DCP, with
  a reader that reads rows in place: see safetensors_reader); what the checkpoint lacks (a new head, RoPE
  buffers, PEFT adapters) is initialized as `from_pretrained` (and peft) would have, from the RNG state the
  skeleton was built with (`loading.missing_values`).
- otherwise (a model object, `.bin` files, files only rank 0 can see, keys that need transformers'
  conversion; `loading.rank0_route`): rank 0's weights are the truth and are broadcast tensor by tensor.
It knows how to shard only through the callable it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..adapters.nf4 import is_nf4
from ..distributed import first_on_any_rank, get_device, log_rank0, warn_rank0
from .facts import facts_of, unwrap_peft
from .missing_values import initial_values, skeleton_rng_state
from .rank0_route import broadcast_buffers, load_parameters_from_rank0, rank0_state
from .safetensors_route import (
    SafetensorsPlan,
    plan_safetensors_load,
    read_safetensors_shards,
    release_free_heap,
    safetensors_shapes,
)
from .skeleton import get_tensor, is_pretrained_model, loaded_values, move_to_meta

ShardFn = Callable[[nn.Module], None]


def load_pretrained(model: nn.Module, shard: ShardFn, offload: bool = False) -> nn.Module:
    """Shard `model` with `shard` and fill every rank's shards with the right weights; verify the result."""
    facts = facts_of(model)
    plan = choose_route(model)
    state = skeleton_rng_state(model)
    if plan is not None:
        facts.missing = list(plan.missing)
        initial = initial_values(model, plan, state)
        shard(model)
        device = materialize(model, offload, skip_nf4=True)
        # NOTE: what the checkpoint lacks goes into its shards before the checkpoint is read, so its full values
        # (every LoRA matrix, whole, on every rank) are freed before the read's peak instead of held through it.
        copy_full_into_shards(model, initial)
        del initial
        if device.type == "cpu":
            release_free_heap()
        read_safetensors_shards(model, facts.source.path, plan, device)
    else:
        weights, buffers = rank0_state(model, state)
        move_to_meta(model, facts.tie_groups)
        shard(model)
        materialize(model, offload)
        load_parameters_from_rank0(model, weights)
        copy_full_into_shards(model, buffers)
        del weights, buffers
        broadcast_buffers(model)
    facts.verify(model)
    loaded_values(unwrap_peft(model)).clear()  # now in the shards
    return model


def choose_route(model: nn.Module) -> SafetensorsPlan | None:
    """Return the plan for reading slices on every rank, or None to broadcast rank 0's weights.

    NOTE: every rank joins the same collective here, even when its own answer is already known, because
    ranks may disagree (a real object on rank 0, a skeleton elsewhere) and must still agree on the route.
    """
    source = facts_of(model).source
    shapes = safetensors_shapes(source.path) if source is not None else None
    if source is None:
        reason = "the model is an object, so rank 0's weights are the truth"
    else:
        reason = needs_conversion(model) or (None if shapes else f"no *.safetensors readable in {source.path}")
    _, reason = first_on_any_rank(reason)
    if reason:
        log_rank0("Loading on rank 0 and broadcasting: %s.", reason)
        return None
    plan = plan_safetensors_load(model, shapes)
    if plan.missing:
        warn_rank0("Not in the checkpoint, newly initialized: %s", plan.missing)
    if plan.unused:
        log_rank0("Checkpoint tensors the model does not use: %s", plan.unused)
    return plan


def needs_conversion(model: nn.Module) -> str | None:
    """Name the reason the checkpoint's keys need transformers' own conversion, or None."""
    model = unwrap_peft(model)
    if not is_pretrained_model(model):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    return f"{type(model).__name__} needs weight conversions ({len(conversions)})" if conversions else None


def materialize(model: nn.Module, offload: bool, skip_nf4: bool = False) -> torch.device:
    """Allocate each rank's shards (values undefined); with CPU offload, shards live in host memory.

    `skip_nf4`: NF4 weights stay on the meta device, for `read_safetensors_shards` makes them from each rank's
    rows; allocating them here too would hold every NF4 shard twice at the load peak.
    """
    device = get_device()
    target = torch.device("cpu") if offload else device
    model._apply(lambda t: t if skip_nf4 and is_nf4(t) else torch.empty_like(t, device=target))
    if offload and device.type != "cpu":
        for module in model.modules():
            for leaf, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[leaf] = buffer.to(device)
    return target


@torch.no_grad()
def copy_full_into_shards(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (identical on every rank) into this rank's shards, without communication."""
    for name, full in values.items():
        copy_full_into(get_tensor(model, name), full)


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy one full tensor into `target`, of which this rank may hold only a shard (a DTensor)."""
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


def shape_mismatch(
    stored: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]
) -> tuple[str, tuple, tuple] | None:
    """The first tensor of `live` that `stored` holds with another shape: (name, stored shape, live shape)."""
    for name, tensor in live.items():
        if tuple(stored[name].shape) != tuple(tensor.shape):
            return name, tuple(stored[name].shape), tuple(tensor.shape)
    return None
