"""Exports of models whose folder format their owner defines: a model that is not a transformers `PreTrainedModel`
(a `SentenceTransformer` writes `modules.json` and a folder per module; a user's `nn.Module` its own files) is
written by the trainer subclass's `_save` or the model's own save, on rank 0, over the gathered full weights.

It knows neither Trainer internals (the trainer hands in its save) nor the formats: it only presents the model
unsharded for the length of one save. The streamed `PreTrainedModel` export is `export.live`'s.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from ..checkpoints.adapters import full_copy
from ..distributed import alone, is_rank0
from ..loading.facts import facts_of
from ..sharding.collective_methods import COLLECTIVE_METHODS
from ..sharding.units import original_class, reshard_all
from .hf_folder import export_dtype, prepare_output, publish

# The method by which a class declares that it writes its own folder, the one every Hugging Face library's models and
# `huggingface_hub.PyTorchModelHubMixin` define (sentence-transformers' too). A method that is merely named `save`
# (a wrapper's checkpoint helper, an unrelated API) declares nothing and is never called by an export.
OWN_SAVE_METHOD = "save_pretrained"


def owner_save(model: nn.Module, trainer_save: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """The save that writes `model`'s own folder format, or None when the streamed export writes what it would.

    A `PreTrainedModel` or PEFT model: None (`save_pretrained`'s format, streamed). Otherwise the trainer subclass's
    own `_save` when it has one (`trainer_save`), else the model class's own `save_pretrained`; a module without
    one gets None: its state dict as `model.safetensors`, which is what `Trainer._save` writes.
    """
    if isinstance(model, PreTrainedModel) or facts_of(model).is_peft:
        return None
    if trainer_save is not None:
        return trainer_save
    if not callable(getattr(original_class(model), OWN_SAVE_METHOD, None)):
        return None
    return lambda directory: getattr(model, OWN_SAVE_METHOD)(directory)


def save_by_owner(
    model: nn.Module, output_dir: str, save: Callable[[str], None], dtype: torch.dtype | None = None
) -> None:
    """Run `save(staging)` on rank 0 with `model` presented unsharded (full weights, no FSDP hooks); publish the
    folder as `output_dir`.

    Rank 0 holds the whole model on the CPU for the save (the owner's save needs every tensor at once, and may run
    forwards: sentence-transformers' model card encodes an example); the other ranks only take part in the gathers.
    A save that fails on rank 0 fails on every rank, with its message.
    NOTE: collective; every rank must call it.

    Raises:
        RuntimeError: on the other ranks when rank 0's save failed (rank 0 raises the save's own error).
    """
    reshard_all(model)
    full = _gather_parameters(model, dtype)
    error: list[str | None] = [None]
    if is_rank0():
        staging = prepare_output(output_dir, overwrite=True)
        try:
            with _presented_unsharded(model, full):
                save(staging)
            publish(staging, output_dir)
        except Exception as failure:
            shutil.rmtree(staging, ignore_errors=True)  # nothing half-written is left beside output_dir
            error[0] = f"{type(failure).__name__}: {failure}"
            share_error(error)
            raise
    share_error(error)
    if error[0] is not None:
        raise RuntimeError(f"rank 0 could not write {output_dir} with {type(model).__name__}'s own save: {error[0]}")


def share_error(error: list[str | None]) -> None:
    """Broadcast rank 0's failure (or None) so no rank waits on a save that will not come."""
    if not alone():
        dist.broadcast_object_list(error, src=0)


def _gather_parameters(model: nn.Module, dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
    """Each unique parameter whole on rank 0's CPU (empty elsewhere), keyed by the id of the live parameter.

    NOTE: collective; every rank gathers the same parameters in the same order. Float32 masters of parameters
    loaded in a lower precision go back to it, as in the streamed export, unless `dtype` is given.
    """
    upcast = facts_of(model).upcast_from
    full: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = full_copy(param)
        if is_rank0():
            full[id(param)] = tensor.to("cpu", export_dtype(tensor.dtype, dtype or upcast.get(name)))
    return full


@contextlib.contextmanager
def _presented_unsharded(model: nn.Module, full: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within the block `model` is a plain module: whole parameters, its modules' own classes, no FSDP forward hooks
    and its class's own `save_pretrained`. Everything is put back after.

    The live model itself, not a copy, because the owner's objects point back at it (sentence-transformers' model
    card data holds the model and encodes an example with it). Plain parameters make `state_dict()` whole: FSDP2's
    state-dict hook moves a unit to its sharded parameters only when the unit is unsharded, and `reshard_all` left
    every unit sharded. Own classes keep fully_shard's `FSDP<Class>` out of saved class names. Without the forward
    hooks a forward on rank 0 alone gathers nothing (with them it would wait for the other ranks forever).
    """
    whole = {key: nn.Parameter(tensor, requires_grad=False) for key, tensor in full.items()}  # one per tied weight
    slots = [(m, leaf, p) for m in model.modules() for leaf, p in m._parameters.items() if p is not None]
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    classes = [type(unit) for unit in units]
    hooks = _fsdp_forward_hooks(units)
    collective = {name: model.__dict__.pop(name) for name in COLLECTIVE_METHODS if name in model.__dict__}
    try:
        for module, leaf, param in slots:
            module._parameters[leaf] = whole[id(param)]
        for unit in units:
            unit.__class__ = original_class(unit)
        for registry, _, ids in hooks:
            for hook_id in ids:
                registry.pop(hook_id, None)
        yield
    finally:
        for registry, snapshot, _ in hooks:
            registry.clear()
            registry.update(snapshot)  # in their order: FSDP2's pre-forward hook runs first
        for unit, cls in zip(units, classes, strict=True):
            unit.__class__ = cls
        model.__dict__.update(collective)
        for module, leaf, param in slots:
            module._parameters[leaf] = param


def _fsdp_forward_hooks(units: list[nn.Module]) -> list[tuple[dict, list, list[int]]]:
    """Each hook registry holding FSDP2's forward hooks of `units`: (registry, its entries now, FSDP2's ids).

    torch 2.13 keeps the handles on each unit's FSDP state (`_pre_forward_hook_handle`, `_post_forward_hook_handle`;
    a `_MultiHandle` of several for grouped units).
    """
    found: dict[int, tuple[dict, list, list[int]]] = {}
    for unit in units:
        state = unit._get_fsdp_state()
        for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
            for single in getattr(handle, "handles", (handle,)):
                registry = single.hooks_dict_ref()
                if registry is None:
                    continue
                entry = found.setdefault(id(registry), (registry, list(registry.items()), []))
                entry[2].append(single.id)
    return list(found.values())
