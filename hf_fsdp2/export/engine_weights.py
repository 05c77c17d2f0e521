"""The live sharded model's full weights for an inference engine (vLLM), one FSDP unit at a time.

An engine that generates for online RL needs the trained weights after every step, whole and under the base model's
names. Each unit is all-gathered once (one collective per unit, in its compute dtype), its weights are handed out
while it is gathered, and it is resharded before the next: a rank holds one unit beside its shards, never the model.
A PEFT model's active LoRA adapter is merged into copies of the base weights (`checkpoints.adapters.merged_state`),
NF4 bases are dequantised, tied weights are named once, and buffers are left out (engines compute their own).
It knows nothing about TRL or vLLM: `hf_fsdp2.trl` hands these buckets to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..adapters.nf4 import is_nf4
from ..checkpoints.adapters import merged_state
from ..checkpoints.sharded import model_state_dict
from ..loading.facts import facts_of
from ..sharding.units import reshard_all

Bucket = list[tuple[str, torch.Tensor]]
# Wrapper segments torch adds to parameter names that state dicts leave out (activation checkpointing, compile).
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unit_buckets(model: nn.Module) -> Iterator[Bucket]:
    """(name, full tensor) of every weight, one bucket per FSDP unit; a bucket is valid until the next is asked for.

    NOTE: collective; every rank iterates to the end, in the same order (each unit is all-gathered when reached).
    """
    reshard_all(model)
    sources, merge = _export_sources(model)
    modules = {_clean(name + ".")[:-1]: module for name, module in model.named_modules()}
    units = {name: module for name, module in modules.items() if isinstance(module, FSDPModule)}
    for unit_name, names in _by_unit(sources, units).items():
        unit = units.get(unit_name)
        if unit is not None:
            unit.unshard()
        try:
            yield [(name, _full(modules, sources[name], name, merge)) for name in names]
        finally:
            if unit is not None:
                unit.reshard()


def named_full_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight as (name, full tensor), unit by unit: a tensor is valid until the next is asked for."""
    for bucket in unit_buckets(model):
        yield from bucket


def _export_sources(model: nn.Module) -> tuple[dict[str, str], Callable[[str, torch.Tensor], torch.Tensor] | None]:
    """Export name → the model's own parameter name, and (PEFT) the function that merges LoRA into a full copy."""
    state = model_state_dict(model)
    parameters = {_clean(name) for name, _ in model.named_parameters(remove_duplicate=False)}
    state = {name: tensor for name, tensor in state.items() if name in parameters}
    if not facts_of(model).is_peft:
        return {name: name for name in state}, None
    export, merge = merged_state(model, state)
    by_tensor = {id(tensor): name for name, tensor in state.items()}
    return {name: by_tensor[id(tensor)] for name, tensor in export.items()}, merge


def _by_unit(sources: dict[str, str], units: dict[str, nn.Module]) -> dict[str, list[str]]:
    """Export names grouped by the FSDP unit that holds their parameter (its nearest unit ancestor), in unit order;
    parameters outside every unit (ignored scalars, an unsharded model) come last, under no unit."""
    owned: dict[str, list[str]] = {name: [] for name in units}
    owned[_NO_UNIT] = []
    for export, source in sources.items():
        path = source.rsplit(".", 1)[0] if "." in source else ""
        owner = max((u for u in units if u == "" or path == u or path.startswith(u + ".")), key=len, default=_NO_UNIT)
        owned[owner].append(export)
    return {unit: names for unit, names in owned.items() if names}


_NO_UNIT = "\0outside every unit"


def _full(
    modules: dict[str, nn.Module], source: str, name: str, merge: Callable[[str, torch.Tensor], torch.Tensor] | None
) -> torch.Tensor:
    """The full value of one weight as the engine loads it, read from the gathered unit."""
    module_path, _, attr = source.rpartition(".")
    tensor = getattr(modules[module_path], attr)  # the unsharded tensor while its unit is gathered
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    if is_nf4(full):
        full = full.get_original_weight()
    if merge is not None:
        full = merge(name, full.clone())  # NOTE: merged into a copy; the gathered buffer is the unit's own
    return full


def _clean(name: str) -> str:
    """`name` without the wrapper segments, as state dicts name it."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name
