"""Adapter-only files for PEFT models, written from and read into the sharded model.

- `save_adapter`: peft's own folder (adapter_model.safetensors + adapter_config.json, other adapters in
  subfolders, as `PeftModel.save_pretrained` lays them out). Only adapter tensors are gathered; no rank
  ever gathers a frozen base weight.
- `load_adapter`: every rank reads the (small) file and copies its own shard of each tensor.
- `merged_state`: the active LoRA adapter folded into gathered copies of the base weights, one tensor at
  a time, by peft's own `get_delta_weight`; the live weights are never touched.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from ..adapters.methods import active_adapter, untracked_trainable
from ..adapters.nf4 import is_nf4
from ..adapters.trainable_tokens import token_layers
from ..distributed import is_rank0, warn_rank0
from ..loading.facts import facts_of
from ..loading.weights import copy_full_into, shape_mismatch
from .sharded import MODEL_KEY, load_in_place, model_dir, read_metadata, validate_checkpoint

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ADAPTER = "default"


def adapter_dir(directory: str, adapter: str) -> str:
    """Where peft keeps an adapter's files: the folder itself for "default", else a subfolder."""
    return directory if adapter == DEFAULT_ADAPTER else os.path.join(directory, adapter)


def adapter_state(model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """peft's file keys → the live parameters (this rank's shards) of one adapter; nothing is gathered.

    Embedding layers are never added (`save_embedding_layers=False`): they are frozen base weights.
    """
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(
        model, state_dict=model.state_dict(keep_vars=True), adapter_name=adapter, save_embedding_layers=False
    )


def check_trainable_are_saved(model: nn.Module) -> None:
    """Raise ValueError if a trainable parameter is in no adapter file (adapter-only checkpoints would drop it).

    Raises:
        ValueError: when a trainable parameter is not part of any PEFT adapter's saved state.
    """
    name = untracked_trainable(model)
    if name is not None:
        raise ValueError(
            f"{name} is trainable but not part of any PEFT adapter, so adapter-only checkpoints would lose "
            "it. Train it through the adapter config (modules_to_save=[...] or trainable_token_indices) or "
            "freeze it."
        )


def full_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A full copy of a possibly sharded tensor (collective for DTensors); an NF4 base weight dequantized."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
    return full.get_original_weight() if is_nf4(full) else full


def save_adapter(model: nn.Module, directory: str) -> int:
    """Write every adapter of `model` as peft's files under `directory`; return the bytes rank 0 wrote.

    NOTE: collective; every rank gathers the adapter tensors in the same order, rank 0 writes.
    """
    written = 0
    for adapter, config in model.peft_config.items():
        full = {key: full_copy(tensor).cpu().contiguous() for key, tensor in adapter_state(model, adapter).items()}
        if not is_rank0():
            continue
        out = adapter_dir(directory, adapter)
        os.makedirs(out, exist_ok=True)
        save_file(full, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = copy.deepcopy(config)
        config.inference_mode = True
        config.save_pretrained(out)
        written += sum(os.path.getsize(os.path.join(out, name)) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))
    return written


def load_adapter(model: nn.Module, directory: str) -> None:
    """Fill every adapter of the sharded `model` from peft files in `directory` (written by any world size).

    Raises:
        ValueError: when `directory` lacks an adapter's weights file, or its tensors' names or shapes differ.
    """
    if not os.path.isfile(os.path.join(directory, ADAPTER_WEIGHTS)) and os.path.isdir(model_dir(directory)):
        _load_adapter_from_model_state(model, directory)
        return
    for adapter in facts_of(model).adapter_names:
        folder = adapter_dir(directory, adapter)
        path = os.path.join(folder, ADAPTER_WEIGHTS)
        if not os.path.isfile(path):
            raise ValueError(
                f"{folder} has no {ADAPTER_WEIGHTS} for adapter {adapter!r}: it is not an adapter checkpoint of "
                "this PEFT model (a full-model checkpoint, or one saved with other adapter names?)."
            )
        _warn_if_other_base(model, adapter, folder)
        stored = load_file(path)
        live = _loadable_state(model, adapter, folder)
        _check_matches(stored, live, folder)
        for key, tensor in live.items():
            copy_full_into(tensor, stored[key])


def _loadable_state(model: nn.Module, adapter: str, folder: str) -> dict[str, torch.Tensor]:
    """peft's file keys → the live tensors that loading the file fills (`adapter_state`'s, except for prompt learning).

    peft saves a prompt-learning adapter as its encoder's output (`prompt_embeddings`), a computed tensor; it is
    the encoder's embedding itself when the encoder has no projection (prompt tuning, prefix tuning without
    `prefix_projection`), which is where peft loads it too.

    Raises:
        ValueError: for an encoder with a projection (p-tuning, prefix_projection=True), whose weights are not saved.
    """
    config = model.peft_config[adapter]
    if not config.is_prompt_learning:
        return adapter_state(model, adapter)
    encoder = model.prompt_encoder[adapter]
    if [name for name, _ in encoder.named_parameters()] != ["embedding.weight"]:
        raise ValueError(
            f"{folder} holds adapter {adapter!r} ({config.peft_type.value}) as peft saves it: the prompt its encoder "
            "computes, not the encoder's weights, so training cannot resume from it. Train from the start, or use "
            "prompt tuning or prefix tuning without prefix_projection, whose saved prompt is the trained embedding."
        )
    return {"prompt_embeddings": encoder.embedding.weight}


def _load_adapter_from_model_state(model: nn.Module, checkpoint: str) -> None:
    """A checkpoint of Trainer + Accelerate's FSDP2 keeps a PEFT model's adapter inside its sharded model state
    (`pytorch_model_fsdp_0/`, under peft's file keys); each rank reads its own shards of it (DCP reshards).

    Raises:
        ValueError: when the model has several adapters (those keys carry no adapter name) or the stored
            tensors do not fit the model's adapter.
    """
    adapters = facts_of(model).adapter_names
    if len(adapters) != 1:
        raise ValueError(
            f"{checkpoint} keeps its adapter inside the model state (Trainer + Accelerate), whose keys name no "
            f"adapter, but this model has adapters {adapters}; resume with a single adapter."
        )
    directory = validate_checkpoint(checkpoint)
    prefix = MODEL_KEY + "."
    stored = {
        key[len(prefix) :]: torch.empty(tuple(md.size), device="meta")
        for key, md in read_metadata(directory).state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(md, "size")
    }
    live = adapter_state(model, adapters[0])
    _check_matches(stored, live, directory)
    load_in_place({MODEL_KEY: {key: tensor.detach() for key, tensor in live.items()}}, directory)


def _check_matches(stored: dict[str, torch.Tensor], live: dict[str, torch.Tensor], folder: str) -> None:
    """Raise ValueError naming the first tensor that the file lacks, has extra, or holds with another shape."""
    missing, extra = sorted(set(live) - set(stored)), sorted(set(stored) - set(live))
    if missing or extra:
        raise ValueError(
            f"the adapter in {folder} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}. "
            "It was saved with another adapter config (target_modules, modules_to_save) or another base model."
        )
    mismatch = shape_mismatch(stored, live)
    if mismatch is not None:
        key, saved, wanted = mismatch
        raise ValueError(
            f"{key} has shape {saved} in {folder} but {wanted} in the model: the adapter was trained on another "
            "base model (other hidden sizes) or with another rank r."
        )


def _warn_if_other_base(model: nn.Module, adapter: str, folder: str) -> None:
    """Warn when the file names another base model than the one being trained (same shapes can hide it)."""
    config_path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        return
    with open(config_path) as f:
        saved = json.load(f).get("base_model_name_or_path")
    current = model.peft_config[adapter].base_model_name_or_path
    if saved and current and os.path.basename(str(saved).rstrip("/")) != os.path.basename(str(current).rstrip("/")):
        warn_rank0("The adapter in %s was trained on %s; loading it into %s.", folder, saved, current)


# ---- merged export ------------------------------------------------------------------------------------

MergeFn = Callable[[str, torch.Tensor], torch.Tensor]


def check_mergeable(model: nn.Module) -> tuple[str, dict[str, nn.Module]]:
    """Raise ValueError if the active adapter cannot be merged here; else return it and its LoRA layers
    by base-weight name. Run it before training too, so a bad combination fails before the run, not after.

    Raises:
        ValueError: when not exactly one adapter is active, it is not plain LoRA, it trains token rows, or it targets
            a tied weight.
    """
    from peft.tuners.lora import LoraLayer

    adapter = active_adapter(model)
    if model.peft_config[adapter].peft_type.value != "LORA":
        raise ValueError(
            f"merge_adapters_on_save supports LoRA adapters; {adapter!r} is "
            f"{model.peft_config[adapter].peft_type.value}. "
            "Save the adapter (the default) and merge it with peft on one process."
        )
    layers = {
        f"{name}.base_layer.weight": module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and adapter in module.scaling
    }
    for module in layers.values():
        _check_variant(module, adapter)
    tokens = [
        name.removesuffix(".token_adapter")
        for name, layer in token_layers(model).items()
        if adapter in layer.token_indices
    ]
    if tokens:
        raise ValueError(
            f"adapter {adapter!r} trains rows of {tokens[0]} (trainable_token_indices), which "
            "merge_adapters_on_save does not merge. Save the adapter (the default) and merge with "
            "PeftModel.from_pretrained(base, folder).merge_and_unload() on one process."
        )
    for names in facts_of(model).tie_groups:
        merged_tied = [n for n in names if n in layers]
        if merged_tied:
            raise ValueError(
                f"{merged_tied[0]} carries a LoRA adapter but is tied to {[n for n in names if n != merged_tied[0]]}: "
                "one tied weight cannot hold the merged head and the unmerged embedding (peft's merge_and_unload "
                "changes both). Save the adapter (the default), or leave lm_head out of target_modules."
            )
    return adapter, layers


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], MergeFn]:
    """Base-model names → live tensors for a merged export, and the function that merges a gathered copy.

    `state` is the sharded state dict of the PEFT model. Adapter tensors and other adapters' copies of
    modules_to_save are left out; the active adapter's copy replaces its original, which stays where the active
    adapter has no copy (as peft's forward and merge_and_unload use it). Which tensor is which, peft's layers say
    (`facts.base_spellings`), not their names.

    Raises:
        ValueError: when the active adapter cannot be merged (`check_mergeable`).
        RuntimeError: for a tensor of `state` the model's facts do not place (the model changed after `describe`).
    """
    adapter, layers = check_mergeable(model)
    facts = facts_of(model)
    replaced = {base for base, copy in facts.base_spellings.values() if copy == adapter}
    export: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for name, tensor in state.items():
        if name not in facts.base_spellings:
            raise RuntimeError(f"{name} is in the model's state but was not under its base model when described.")
        base, copy = facts.base_spellings[name]
        if facts.is_adapter(name) or copy not in (None, "", adapter) or (copy == "" and base in replaced):
            continue
        export[base] = tensor
        sources[base] = name

    def merge(export_name: str, full: torch.Tensor) -> torch.Tensor:
        layer = layers.get(sources[export_name])
        if layer is None:
            return full
        # NOTE: `full` is a gathered copy; adding peft's delta to it is peft's (safe) merge, on a copy.
        full += _delta_weight(layer, adapter).to(full.device, full.dtype)
        return full

    return export, merge


def _check_variant(layer: nn.Module, adapter: str) -> None:
    """Refuse LoRA variants whose merge needs more than the delta weight (DoRA, LoRA bias, other variants)."""
    if layer.use_dora.get(adapter) or adapter in getattr(layer, "lora_variant", {}) or layer.lora_bias.get(adapter):
        raise ValueError(
            f"adapter {adapter!r} uses a LoRA variant (DoRA, lora_bias, ...) that merge_adapters_on_save does not "
            "merge. Save the adapter (the default) and merge with PeftModel.from_pretrained(base, folder)"
            ".merge_and_unload() on one process."
        )


def _delta_weight(layer: nn.Module, adapter: str) -> torch.Tensor:
    """peft's own `get_delta_weight`, run on a shallow clone of `layer` that holds full copies of its adapter.

    NOTE: collective (gathers the adapter's shards); every rank computes the same small product.
    """
    clone = copy.copy(layer)
    clone._modules = dict(layer._modules)
    for attr in ("lora_A", "lora_B"):
        modules: nn.ModuleDict | None = layer._modules.get(attr)
        if modules is not None and adapter in modules:
            inner = copy.copy(modules[adapter])
            inner._parameters = {
                k: None if p is None else nn.Parameter(full_copy(p)) for k, p in inner._parameters.items()
            }
            clone._modules[attr] = nn.ModuleDict({adapter: inner})
    for attr in ("lora_embedding_A", "lora_embedding_B"):
        params: nn.ParameterDict | None = layer._modules.get(attr)
        if params is not None and adapter in params:
            clone._modules[attr] = nn.ParameterDict({adapter: nn.Parameter(full_copy(params[adapter]))})
    with torch.no_grad():
        return clone.get_delta_weight(adapter)
