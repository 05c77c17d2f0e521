"""What the planner's arithmetic needs from a model: its element counts and bytes by role (sharded, trainable,
per unit, NF4), counted on a meta skeleton of its config. Nothing but config.json is read."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..adapters.nf4 import NF4_BYTES_PER_ELEMENT
from ..loading.skeleton import auto_class_for
from .plan_types import PlanRequest


@dataclass
class ModelSizes:
    """What the arithmetic needs from the model: element counts and bytes, by role."""

    params_bytes: int  # every parameter as stored on a rank before sharding (fp32 masters counted at 4 bytes)
    trainable_numel: int
    trainable_bytes: int  # as stored (fp32 masters under bf16)
    buffers_bytes: int
    largest_tensor_bytes: int  # as stored in the checkpoint
    largest_unit_numel: int
    largest_unit_trainable_numel: int
    root_numel: int
    new_bytes: int  # tensors no base checkpoint holds (LoRA adapters), as loading initializes them
    block_classes: list[str]
    config: Any = None
    load_dtype: torch.dtype = torch.float32
    # Set when transformers must convert the checkpoint's keys (fused MoE experts, renamed VLM modules): loading
    # then builds the whole model on rank 0 and sends it out (see `loading.weights.choose_route`); its bytes as loaded.
    rank0_load_bytes: int = 0
    # QLoRA: NF4 elements in the largest unit, and the largest NF4 weight (dequantized whole in each F.linear).
    largest_unit_nf4_numel: int = 0
    largest_nf4_numel: int = 0
    # Shapes of the trainable parameters, and of those hf_fsdp2.Muon gives to Muon (optimizer state by real size);
    # none given: the trainable elements count as one vector.
    trainable_shapes: tuple[tuple[int, ...], ...] = ()
    muon_shapes: tuple[tuple[int, ...], ...] = ()
    params_numel: int = 0  # every parameter's elements (the gathered model of generate)


def model_sizes(request: PlanRequest) -> ModelSizes:
    """Count parameters by role on a meta skeleton of the request's config (with its LoRA adapters)."""
    config = request.config if request.config is not None else load_config(request.model)
    shards = request.nproc // request.hsdp if request.qlora else None
    return skeleton_sizes(config, lora_config(request) if request.lora_r else None, request.bf16, shards)


def skeleton_sizes(config: Any, lora: Any, bf16: bool, nf4_shards: int | None = None) -> ModelSizes:
    """Count parameters by role on a meta skeleton of `config`, wrapped with the peft `lora` config if given;
    with `nf4_shards`, the weights that are NF4 at that shard count are counted in NF4 bytes (QLoRA)."""
    from ..adapters.nf4 import nf4_candidates
    from ..config import FSDP2Config
    from ..loading.weights import needs_conversion
    from ..optim.muon_routing import split_for_muon
    from ..sharding.units import block_classes, select_units

    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        model: nn.Module = auto_class_for(config).from_config(config, dtype=dtype)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(lora))
    units = select_units(model, FSDP2Config())
    converted = needs_conversion(model) is not None
    in_units = {id(p) for unit in units for p in unit.parameters()}
    stored: dict[int, float] = {id(p): _stored_bytes(p, bf16) for p in model.parameters()}
    nf4_names = nf4_candidates(model, nf4_shards)[0] if nf4_shards else []
    nf4 = {id(model.get_parameter(n)): model.get_parameter(n) for n in nf4_names}
    stored.update(dict.fromkeys(nf4, NF4_BYTES_PER_ELEMENT))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelSizes(
        params_bytes=int(sum(p.numel() * stored[id(p)] for p in model.parameters())),
        params_numel=sum(p.numel() for p in model.parameters()),
        trainable_numel=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * stored[id(p)] for p in trainable),
        buffers_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        largest_tensor_bytes=max(p.numel() * p.element_size() for p in model.parameters()),
        largest_unit_numel=max((sum(p.numel() for p in unit.parameters()) for unit in units), default=0),
        largest_unit_trainable_numel=max(
            (sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in units), default=0
        ),
        root_numel=sum(p.numel() for p in model.parameters() if id(p) not in in_units),
        new_bytes=sum(p.numel() * p.element_size() for p in trainable) if lora is not None else 0,
        block_classes=block_classes(model, FSDP2Config()),
        config=config,
        load_dtype=dtype,
        rank0_load_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) if converted else 0,
        largest_unit_nf4_numel=max((sum(p.numel() for p in u.parameters() if id(p) in nf4) for u in units), default=0),
        largest_nf4_numel=max((p.numel() for p in nf4.values()), default=0),
        trainable_shapes=tuple(tuple(p.shape) for p in trainable),
        muon_shapes=tuple(tuple(p.shape) for p in split_for_muon(model)[0]),
    )


def load_config(model: str) -> Any:
    """The model's config from a folder or a config.json file.

    Raises:
        ValueError: when there is no config.json at `model`.
    """
    from transformers import AutoConfig

    path = os.path.dirname(model) if model.endswith(".json") else model
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{model}: no config.json there; pass a model folder or its config.json.")
    return AutoConfig.from_pretrained(path)


def lora_config(request: PlanRequest) -> Any:
    """The peft LoraConfig of a request's LoRA rank and targets (alpha does not change memory: 2r)."""
    from peft import LoraConfig

    targets = request.lora_targets
    return LoraConfig(
        r=request.lora_r,
        lora_alpha=2 * request.lora_r,
        target_modules=targets if isinstance(targets, str) else list(targets),
    )


def _stored_bytes(param: torch.Tensor, bf16: bool) -> int:
    """Bytes per element of a parameter's shard: trainable low-precision ones become fp32 masters under bf16."""
    if bf16 and param.requires_grad and param.dtype != torch.float32:
        return 4
    return param.element_size()
