"""Hugging Face folders from the live sharded model (`save_pretrained_sharded`, used by `FSDP2Trainer.save_model`,
the sharded model's `save_pretrained` and the end-of-training callback): gathered one tensor at a time, so rank 0's
peak is about one full tensor, not the model. Offline, from a checkpoint: `consolidation`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from transformers import PreTrainedModel

from ..checkpoints.adapters import full_copy, merged_state, save_adapter
from ..checkpoints.disk_space import check_room, raise_if_write_failed
from ..checkpoints.sharded import model_state_dict
from ..config import resolve_dtype
from ..distributed import is_rank0
from ..loading.facts import facts_of
from ..sharding.units import original_class, reshard_all
from .hf_folder import TensorSpec, export_dtype, prepare_output, publish, write_weights
from .owner import owner_save, save_by_owner


def write_model_files(
    model: nn.Module | None, directory: str, processing_class: Any = None, dtype: torch.dtype | None = None
) -> None:
    """Write config, generation config and tokenizer files of `model` (rank 0 only; None: tokenizer only).

    config.json is the one `model.save_pretrained` would write unsharded: its own class in `architectures`
    and the dtype of the written weights (`dtype`, else the parameters'). Only a `PreTrainedModel` gets one: a
    `SentenceTransformer`'s `config` is its transformer's, and a folder whose config.json names
    `SentenceTransformer` loads with random weights and no error.
    """
    config = getattr(model, "config", None) if isinstance(model, PreTrainedModel) else None
    if config is not None:
        config = copy.deepcopy(config)
        config.architectures = [original_class(model).__name__]
        weights_dtype = dtype if dtype is not None else getattr(model, "dtype", None)
        if isinstance(weights_dtype, torch.dtype):
            config.dtype = str(weights_dtype).removeprefix("torch.")
        config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(directory)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)


def save_pretrained_sharded(
    model: nn.Module,
    output_dir: str,
    processing_class: Any = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    merge_adapters: bool = False,
    trainer_save: Callable[[str], None] | None = None,
) -> None:
    """Write the live sharded model as a Hugging Face folder, gathering one tensor at a time.

    A PEFT model is written as its adapter folder (`PeftModel.from_pretrained` loads it), or with
    `merge_adapters` as the full model with the active LoRA adapter merged into copies of the base weights.
    A model that is not a `PreTrainedModel` is written in its own format: by `trainer_save` (a trainer
    subclass's own `_save`) or its own save method, on gathered weights (`export.owner`).
    NOTE: collective; every rank must call it. Only rank 0 holds a full tensor, one at a time, and writes.

    Raises:
        ValueError: when `merge_adapters` is set without PEFT adapters, or the active adapter cannot be merged.
    """
    reshard_all(model)
    peft = facts_of(model).is_peft
    if merge_adapters and not peft:
        raise ValueError("merge_adapters_on_save=True, but the model has no PEFT adapters to merge; turn it off.")
    save = owner_save(model, trainer_save)
    if save is not None:
        if save is not trainer_save:
            save = _with_processing_class(save, processing_class)
        save_by_owner(model, output_dir, save, resolve_dtype(dtype))
        return
    staging, need, error = "", 0, None
    try:
        own = _export_bytes(model, dtype, adapter_only=peft and not merge_adapters) if is_rank0() else 0
        need = check_room(output_dir, own, what="export")  # fails at once, on every rank, when plainly full
        staging = prepare_output(output_dir, overwrite=True) if is_rank0() else ""
        _write_export(model, staging, processing_class, dtype, max_shard_size, peft and not merge_adapters)
    except (Exception, CheckpointException) as caught:  # NOTE: every rank learns of it below
        error = caught
    raise_if_write_failed(error, output_dir, staging, need, what="export")
    if is_rank0():
        publish(staging, output_dir)
    dist.barrier()


def _write_export(
    model: nn.Module, staging: str, processing_class: Any, dtype: str | None, max_shard_size: str | int, adapter: bool
) -> None:
    """Write the export's files into `staging` (rank 0; the other ranks join the gathers)."""
    if adapter:
        save_adapter(model, staging)
        if is_rank0():
            write_model_files(None, staging, processing_class)
        return
    written = _write_weights_gathered(model, staging, dtype, max_shard_size)
    if is_rank0():
        base = model.get_base_model() if facts_of(model).is_peft else model
        write_model_files(base, staging, processing_class, written)


def _export_bytes(model: nn.Module, dtype: str | None, adapter_only: bool) -> int:
    """The bytes of the weights an export writes: the adapters' (trainable) tensors, or every tensor in its dtype."""
    if adapter_only:
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    target, upcast = resolve_dtype(dtype), facts_of(model).upcast_from
    return sum(
        t.numel() * export_dtype(t.dtype, target or upcast.get(name)).itemsize
        for name, t in model_state_dict(model).items()
    )


def _with_processing_class(save: Callable[[str], None], processing_class: Any) -> Callable[[str], None]:
    """The model's own save followed by the processing class's, as Trainer's `_save` writes both."""
    if not hasattr(processing_class, "save_pretrained"):
        return save

    def save_both(directory: str) -> None:
        save(directory)
        processing_class.save_pretrained(directory)

    return save_both


def _write_weights_gathered(
    model: nn.Module, staging: str, dtype: str | None, max_shard_size: str | int
) -> torch.dtype | None:
    """Gather each tensor (merging LoRA into copies for a PEFT model) and let rank 0 write safetensors files.

    Without `dtype`, float32 masters of parameters loaded in a lower precision go back to it. Returns the one
    floating dtype written (None when several are).
    """
    target = resolve_dtype(dtype)
    state = model_state_dict(model)
    upcast = facts_of(model).upcast_from
    merge = None
    if facts_of(model).is_peft:
        state, merge = merged_state(model, state)
    specs = [
        TensorSpec(name, tuple(t.shape), export_dtype(t.dtype, target or upcast.get(name))) for name, t in state.items()
    ]

    def fetch(spec: TensorSpec) -> torch.Tensor | None:
        tensor = state[spec.name]
        full = full_copy(tensor)
        if merge is not None:
            full = merge(spec.name, full)
        return full if is_rank0() else None

    write_weights(staging, specs, fetch, max_shard_size, write=is_rank0(), fetch_all=True)
    floating = {spec.dtype for spec in specs if spec.dtype.is_floating_point}
    return floating.pop() if len(floating) == 1 else None
