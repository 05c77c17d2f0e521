"""prepare_model: the load → shard pipeline in one call, for the trainer and for scripts.

It composes `sharding` (how units are built) with `loading` (where weights come from) and adds the
gradient helpers a sharded model needs; it knows nothing about the Trainer.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .adapters.methods import check_supported
from .adapters.nf4 import describe_dense, nf4_candidates, quantize_skeleton
from .config import FSDP2Config
from .distributed import check_same_on_all_ranks, get_device, init_distributed, log_rank0
from .export.live import save_pretrained_sharded
from .loading.branches import attach_branch_guard, branch_names
from .loading.facts import ModelFacts, describe, facts_of
from .loading.weights import load_pretrained
from .meshes import build_mesh
from .sharding.collective_methods import attach_collective_methods
from .sharding.float8 import check_float8_machine, convert_float8, refresh_float8_scales
from .sharding.units import (
    mixed_precision_policy,
    original_class,
    reduce_scalar_gradients,
    reshard_all,
    select_units,
    shard_model,
    upcast_trainable,
)

SHARDING_ATTR = "_hf_fsdp2_sharding"
# The FSDP2Config fields that decide how a model is sharded; the others (saving, export) may differ between
# trainers that share one sharded model.
_SHARDING_FIELDS = (
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "min_num_params",
    "reshard_after_forward",
    "cpu_offload",
    "fsdp_activation_checkpointing",
    "compile",
    "hsdp_replicate_size",
    "branch_modules",
    "base_quantization",
    "float8",
)


def prepare_model(
    model: nn.Module, config: FSDP2Config, bf16: bool = False, fp16: bool = False, facts: ModelFacts | None = None
) -> nn.Module:
    """Shard `model` (a meta skeleton or an object with weights) and load every rank's part of its weights.

    `facts` is the caller's description of `model` if it already made one (the trainer does, for its checks, which
    include `check_supported`); it is attached to the model and handed down to loading, sharding, checkpoints and
    export.

    A model this function already sharded (a second trainer on the same model) is returned as it is when
    it was sharded the same way; otherwise ValueError names what differs.

    Raises:
        ValueError: when cpu_offload=True without an accelerator, float8=True without FP8 tensor cores or on a
            model it does not handle, the config is invalid or differs across ranks, or `model` was already sharded
            another way.
    """
    init_distributed()
    check_same_on_all_ranks("FSDP2Config", config.to_summary())
    policy = mixed_precision_policy(config, bf16=bf16, fp16=fp16)
    wanted = sharding_summary(config, policy)
    if isinstance(model, FSDPModule):
        return _reuse_sharded(model, wanted)
    if config.cpu_offload and get_device().type == "cpu":
        raise ValueError(
            "cpu_offload=True moves shards from an accelerator to host memory, but this machine has no "
            "accelerator (parameters already live in host memory); remove cpu_offload."
        )
    if config.float8:
        check_float8_machine(get_device())
    _refuse_bitsandbytes(model)
    vetted = facts is not None  # NOTE: a caller that described the model has checked its PEFT methods (one check)
    facts = describe(model, facts)
    if facts.is_peft and not vetted:
        check_supported(model)
    mesh = build_mesh(config.hsdp_replicate_size)
    nf4 = config.base_quantization == "nf4" or (facts.source is not None and facts.source.quantization == "nf4")
    if config.float8:
        convert_float8(model, facts.is_peft, nf4, policy)  # NOTE: before the units: a unit may be a Linear it swaps
    if nf4:
        quantize_base(model, mesh.size(mesh.ndim - 1))
    units = select_units(model, config)

    def shard(skeleton: nn.Module) -> None:
        upcast_trainable(skeleton, policy)
        shard_model(skeleton, mesh, config, policy, units)

    model = load_pretrained(model, shard, offload=config.cpu_offload)
    reduce_scalar_gradients(model)
    if config.float8:
        refresh_float8_scales(model)
    attach_branch_guard(model, branch_names(model, facts.branches[0], config.branch_modules), facts.branches[1])
    attach_collective_methods(model, save_pretrained_sharded, gather_for_generate=config.gather_for_generate)
    report_own_class_names(model)
    setattr(model, SHARDING_ATTR, wanted)
    log_rank0(
        "Sharded %s into %d units + root over mesh %s (%s parameters).",
        type(model).__name__,
        len(units),
        tuple(mesh.shape),
        f"{sum(p.numel() for p in model.parameters()):,}",
    )
    return model


def report_own_class_names(model: nn.Module) -> None:
    """Let each unit's `_get_name()` (its repr, and what Trainer reads) name its own class, not `FSDP<Class>`.

    NOTE: Trainer's label smoothing shifts the labels only for a model whose `_get_name()` is a causal LM class name;
    under fully_shard's `FSDPLlamaForCausalLM` it smoothed unshifted labels, silently (tests/test_argument_verdicts.py).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.__dict__["_get_name"] = functools.partial(str, original_class(module).__name__)


def _refuse_bitsandbytes(model: nn.Module) -> None:
    """A model bitsandbytes already quantized cannot be sharded (its quantization state stays whole per rank).

    Raises:
        ValueError: naming what to pass instead.
    """
    found = quantized_by_bitsandbytes(model)
    if found:
        raise ValueError(
            f"{type(model).__name__} was quantized by bitsandbytes ({found}), whose quantized weights FSDP2 cannot "
            "shard. Pass the path instead: FSDP2Trainer(model='path/to/hf-model', ...) with "
            "hf_fsdp2.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4')) or FSDP2Config(base_quantization='nf4'): the base becomes torchao NF4, "
            "sharded."
        )


def quantized_by_bitsandbytes(model: nn.Module) -> str | None:
    """What shows that bitsandbytes quantized `model` (None: nothing), asked of the owners, not of class names:
    transformers' record of a bitsandbytes `quantization_config` (`hf_quantizer`, `is_loaded_in_4bit/8bit`), then
    bitsandbytes' own parameter types (`Params4bit`, `Int8Params`), which every one of its quantized layers holds
    (Linear4bit, Linear8bitLt, their 4- and 8-bit embeddings, subclasses).

    bitsandbytes is not imported here: a parameter can only be one of its types once it was imported.
    """
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    method = getattr(config, "quant_method", None)
    if str(getattr(method, "value", method)) == "bitsandbytes":
        return f"quantization_config {type(config).__name__}"
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit"):
        if getattr(model, flag, False):
            return flag
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return None
    quantized = (bnb.nn.Params4bit, bnb.nn.Int8Params)
    for name, module in model.named_modules():
        if any(isinstance(param, quantized) for param in module.parameters(recurse=False)):
            return f"{name}: {type(module).__name__}"
    return None


def quantize_base(model: nn.Module, shards: int) -> None:
    """Make the frozen base's eligible linear weights NF4 on the skeleton, before sharding (QLoRA).

    Raises:
        ValueError: when the model is not a skeleton read from safetensors (NF4 shards are made from each rank's
            own rows), or no weight can be NF4 at this world size.
    """
    source = facts_of(model).source
    if source is None:
        raise ValueError(
            "base_quantization='nf4' quantizes each rank's rows as it reads them from the checkpoint, so the model "
            "must come as a path: FSDP2Trainer(model='path/to/hf-model', ...) or hf_fsdp2.from_pretrained(path)."
        )
    names, dense = nf4_candidates(model, shards)
    if not names:
        example = "; ".join(f"{name}: {why}" for name, why in list(dense.items())[:1]) or "no frozen linear weight"
        raise ValueError(
            f"base_quantization='nf4': no weight of {type(model).__name__} can be NF4 at {shards} shards "
            f"({example}); freeze the base (LoRA) and check the shapes."
        )
    quantize_skeleton(model, names)
    log_rank0("NF4 base: %d weights quantized; %d kept dense (%s).", len(names), len(dense), describe_dense(dense))


def sharding_summary(config: FSDP2Config, policy: MixedPrecisionPolicy) -> dict[str, Any]:
    """What decides a model's sharding: the config's sharding fields, precision and the world size."""
    summary = {name: value for name, value in config.to_summary().items() if name in _SHARDING_FIELDS}
    summary["param_dtype"] = str(policy.param_dtype)
    summary["reduce_dtype"] = str(policy.reduce_dtype)
    summary["world_size"] = dist.get_world_size()
    return summary


def _reuse_sharded(model: nn.Module, wanted: dict[str, Any]) -> nn.Module:
    """Hand back a model sharded earlier (a second trainer, model reuse), or name how it was sharded otherwise."""
    had = getattr(model, SHARDING_ATTR, None)
    if had is None:
        raise ValueError(
            f"{type(model).__name__} was already sharded with fully_shard outside hf_fsdp2, so its precision, units "
            "and mesh are unknown here. Pass the unsharded model (FSDP2Trainer shards it itself)."
        )
    conflicts = [
        f"{name}: {had.get(name)!r} then, {value!r} now" for name, value in wanted.items() if had.get(name) != value
    ]
    if conflicts:
        raise ValueError(
            f"this {type(model).__name__} was already sharded by an earlier FSDP2Trainer with other settings ("
            + "; ".join(conflicts)
            + "). Use the same FSDP2Config, bf16 setting and world size, or build a fresh model for the new trainer."
        )
    reshard_all(model)
    log_rank0("%s is already sharded the same way; reusing it as it is.", type(model).__name__)
    return model


@torch.no_grad()
def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Return the global gradient norm over all ranks and clip to `max_norm` (inf: only measure)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    sharded = [g for g in grads if isinstance(g, DTensor)]
    # Gradients of parameters FSDP leaves whole (0-dim ones) are already averaged and equal on every rank.
    whole = [g for g in grads if not isinstance(g, DTensor)]
    norms = []
    if sharded:
        # NOTE: the norm of sharded gradients is a partial sum until reduced across the mesh.
        norms.append(torch.nn.utils.get_total_norm(sharded).full_tensor())
    if whole:
        norms.append(torch.nn.utils.get_total_norm(whole))
    total = (
        norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    )
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef.device.type == "cpu" and float(coef) == 1.0:
            # NOTE: g * 1.0 == g exactly. Gradients on the host (CPU training, cpu_offload) skip a pass that reads and
            # writes every one of them, measured at about half of AdamW's fused step over the same shards; on an
            # accelerator the test would wait for the device, so the multiply runs.
            return total
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return total
