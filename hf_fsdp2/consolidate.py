"""Hugging Face folders that `from_pretrained` loads, written tensor by tensor: offline from a sharded
checkpoint (`consolidate`, the CLI) or from the live sharded model (`save_pretrained_sharded`, used by
`FSDP2Trainer.save_model` and the end-of-training callback). Peak memory is about twice the largest
tensor (offline: reads of up to that many bytes, a layer or so; live: one gathered tensor), not the model.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .adapter_checkpoint import full_copy, merged_state, save_adapter
from .checkpoint import MODEL_KEY, load_in_place, model_state_dict, read_metadata, validate_checkpoint
from .config import resolve_dtype
from .distcp_reader import SafeFileSystemReader
from .distributed import is_rank0
from .facts import facts_of
from .hf_export import TensorSpec, prepare_output, publish, write_order, write_weights
from .sharding import original_class, reshard_all

# Files beside the weights that make a folder loadable (config) and usable (generation, tokenizer).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _export_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """Cast floating tensors to the requested dtype; leave integer and bool tensors alone."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def consolidate(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    overwrite: bool = False,
) -> str:
    """Turn a sharded checkpoint (ours or Trainer + Accelerate's) into a `from_pretrained`-ready folder.

    Raises:
        ValueError: when the checkpoint is incomplete, corrupt, or has no model tensors or config.json, or
            `output_dir` is not empty and `overwrite` is False.
    """
    directory = validate_checkpoint(checkpoint_dir)
    target = resolve_dtype(dtype)
    stored = {
        key[len(MODEL_KEY) + 1 :]: md
        for key, md in read_metadata(directory).state_dict_metadata.items()
        if key.startswith(MODEL_KEY + ".") and isinstance(md, TensorStorageMetadata)
    }
    if not stored:
        raise ValueError(f"{directory} holds no model tensors (is it an optimizer_0 folder?).")
    source = _model_files_dir(checkpoint_dir, directory)
    specs = [TensorSpec(k, tuple(md.size), _export_dtype(md.properties.dtype, target)) for k, md in stored.items()]
    specs = write_order(specs, max_shard_size)  # batches are read in the order the files are written
    staging = prepare_output(output_dir, overwrite)
    reader = SafeFileSystemReader(directory, cache_metadata=True)
    batches = read_batches(specs, max(spec.nbytes for spec in specs))
    loaded: dict[str, torch.Tensor] = {}

    def fetch(spec: TensorSpec) -> torch.Tensor:
        if spec.name not in loaded:
            batch = {s.name: torch.empty(s.shape, dtype=stored[s.name].properties.dtype) for s in next(batches)}
            load_in_place({MODEL_KEY: batch}, directory, reader, collective=False)
            loaded.update(batch)
        return loaded.pop(spec.name)

    try:
        write_weights(staging, specs, fetch, max_shard_size)
        _copy_model_files(source, staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, output_dir)
    return output_dir


def read_batches(specs: list[TensorSpec], budget: int) -> Iterator[list[TensorSpec]]:
    """Consecutive tensors, in write order, grouped up to `budget` bytes of storage per DCP read.

    NOTE: one DCP request per tensor spent ~2 ms each on planning; with the budget set to the largest
    tensor, a whole decoder layer comes in one request while the peak stays what reading that tensor
    alone already costs.
    """
    batch: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if batch and size + spec.nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(spec)
        size += spec.nbytes
    if batch:
        yield batch


def _model_files_dir(checkpoint_dir: str, directory: str) -> str:
    """Find config.json: in the checkpoint-N folder (ours, or when given its pytorch_model_fsdp_0)."""
    for candidate in (checkpoint_dir, os.path.dirname(os.path.abspath(directory))):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise ValueError(
        f"no config.json beside {directory}; from_pretrained needs it. Copy the model's config.json "
        "into the checkpoint folder and run again."
    )


def _copy_model_files(source: str, destination: str, dtype: torch.dtype | None) -> None:
    """Copy config/generation/tokenizer files; config.json records the export dtype and real class names."""
    for name in MODEL_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), os.path.join(destination, name))
    _mend_config(os.path.join(destination, "config.json"), dtype)


def _mend_config(path: str, dtype: torch.dtype | None) -> None:
    """Make a copied config.json say what `save_pretrained` would: the dtype written, the model's own class.

    Checkpoints written by earlier hf_fsdp2 versions named fully_shard's generated `FSDP<Class>` in `architectures`;
    the prefix is dropped as transformers' own `save_pretrained` drops it.
    """
    with open(path) as f:
        config = json.load(f)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    if config.get("architectures"):
        config["architectures"] = [name.removeprefix("FSDP") for name in config["architectures"]]
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def write_model_files(
    model: nn.Module | None, directory: str, processing_class: Any = None, dtype: torch.dtype | None = None
) -> None:
    """Write config, generation config and tokenizer files of `model` (rank 0 only; None: tokenizer only).

    config.json is the one `model.save_pretrained` would write unsharded: its own class in `architectures`
    and the dtype of the written weights (`dtype`, else the parameters').
    """
    config = getattr(model, "config", None)
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
) -> None:
    """Write the live sharded model as a Hugging Face folder, gathering one tensor at a time.

    A PEFT model is written as its adapter folder (`PeftModel.from_pretrained` loads it), or with
    `merge_adapters` as the full model with the active LoRA adapter merged into copies of the base weights.
    NOTE: collective; every rank must call it. Only rank 0 holds a full tensor, one at a time, and writes.

    Raises:
        ValueError: when `merge_adapters` is set without PEFT adapters, or the active adapter cannot be merged.
    """
    reshard_all(model)
    peft = facts_of(model).is_peft
    if merge_adapters and not peft:
        raise ValueError("merge_adapters_on_save=True, but the model has no PEFT adapters to merge; turn it off.")
    staging = prepare_output(output_dir, overwrite=True) if is_rank0() else ""
    if peft and not merge_adapters:
        save_adapter(model, staging)
        if is_rank0():
            write_model_files(None, staging, processing_class)
    else:
        written = _write_weights_gathered(model, staging, dtype, max_shard_size)
        if is_rank0():
            write_model_files(model.get_base_model() if peft else model, staging, processing_class, written)
    if is_rank0():
        publish(staging, output_dir)
    dist.barrier()


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
        TensorSpec(name, tuple(t.shape), _export_dtype(t.dtype, target or upcast.get(name)))
        for name, t in state.items()
    ]

    def fetch(spec: TensorSpec) -> torch.Tensor | None:
        tensor = state[spec.name]
        full = full_copy(tensor)
        if merge is not None:
            full = merge(spec.name, full)
        return full if is_rank0() else None

    write_weights(staging, specs, fetch, max_shard_size, write=is_rank0())
    floating = {spec.dtype for spec in specs if spec.dtype.is_floating_point}
    return floating.pop() if len(floating) == 1 else None
