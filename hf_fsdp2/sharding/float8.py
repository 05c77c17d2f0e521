"""FP8 training of a model's Linear layers (FSDP2Config(float8=True)) with torchao's float8: which layers convert,
what it needs of the machine and the model, and the weight scales each training forward uses.

It swaps modules of a model in place before sharding; it knows nothing of loading, checkpoints or the Trainer.
torchao's `Float8Linear` keeps `weight` and `bias` under their names and in their dtype (the fp32 masters), so
loading, optimizers, checkpoints and export see the same tensors: FP8 exists only in the all-gather (each rank casts
its shard) and the matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ..adapters.nf4 import dense_roles
from ..distributed import log_rank0

# FP8 tensor cores (torch._scaled_mm): Ada (8.9), Hopper (9.0), Blackwell (10.0, 12.0).
FP8_CAPABILITY = (8, 9)
# The recipe: tensorwise dynamic scales, whose weight casts FSDP2 all-gathers in FP8 (torchtitan's and Accelerate's
# setting for FSDP2; rowwise scales cannot be all-gathered in FP8).
RECIPE = "tensorwise"
_NOT_WHERE = "Remove float8=True: the same model trains in bf16 (TrainingArguments(bf16=True))."


def check_float8_machine(device: torch.device) -> None:
    """Refuse FP8 training on a machine without FP8 tensor cores.

    Raises:
        ValueError: on the CPU, and on a GPU whose compute capability is below 8.9, naming the GPU.
    """
    if device.type != "cuda":
        raise ValueError(
            "FSDP2Config(float8=True) computes the Linear layers with FP8 matmuls (torch._scaled_mm), which need a "
            "CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, H100, H200, B200); this "
            f"process runs on {device.type}. {_NOT_WHERE}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ValueError(
            f"FSDP2Config(float8=True) needs FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, H100, H200, "
            f"B200); {torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}. "
            f"{_NOT_WHERE}"
        )


def check_float8_model(model: nn.Module, is_peft: bool, nf4: bool, policy: MixedPrecisionPolicy) -> None:
    """Refuse the models and precisions FP8 training is not built for here.

    Raises:
        ValueError: for an NF4 base, a PEFT model, or compute in another dtype than bfloat16.
    """
    if nf4:
        raise ValueError(
            "FSDP2Config(float8=True) with an NF4 base (base_quantization='nf4' or from_pretrained's 4-bit "
            "quantization_config): the frozen base is stored in 4 bits, float8 trains full-precision weights through "
            "FP8 matmuls. Choose one: QLoRA without float8, or a full fine-tune with it."
        )
    if is_peft:
        raise ValueError(
            f"FSDP2Config(float8=True) converts the Linear layers a full fine-tune trains; {type(model).__name__} is "
            "a PEFT model, whose frozen base and adapters float8 does not handle here. Train the adapters without "
            "float8, or fine-tune the whole model with it."
        )
    if policy.param_dtype != torch.bfloat16:
        raise ValueError(
            f"FSDP2Config(float8=True) computes everything but the FP8 matmuls in bfloat16; compute here would be "
            f"{policy.param_dtype or 'the weights own dtype'}. Set TrainingArguments(bf16=True) (and no fp16=True, "
            "no other param_dtype)."
        )


def torchao_float8() -> Any:
    """torchao's float8 package.

    Raises:
        ValueError: when torchao is not installed, naming the version to install.
    """
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ValueError(
            "FSDP2Config(float8=True) trains with torchao's float8: pip install 'torchao>=0.18,<0.19' (the version "
            f"tested; the 'qlora' extra installs it). ({error})"
        ) from None
    return float8


def float8_layers(model: nn.Module) -> list[str]:
    """The Linear layers float8 converts, by name: those torchao's tensorwise filter takes (both dimensions divisible by
    16, and not so small that FP8 runs slower: `_auto_filter_for_recipe`), except the head and the input embeddings
    by their role, whatever their names (`adapters.nf4.dense_roles`: a tied or untied LM head, a task head)."""
    float8 = torchao_float8()
    takes = float8._auto_filter_for_recipe(RECIPE, filter_fqns=[])
    kept = dense_roles(model)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and id(module) not in kept and takes(module, name)
    ]


def convert_float8(model: nn.Module, is_peft: bool, nf4: bool, policy: MixedPrecisionPolicy) -> list[str]:
    """Swap the `float8_layers` of `model` (before sharding; a skeleton on meta or weights) for torchao's Float8Linear,
    whose weights FSDP2 all-gathers as FP8 casts; return their names.

    Raises:
        ValueError: for what `check_float8_model` refuses, and when no layer of the model qualifies.
    """
    check_float8_model(model, is_peft, nf4, policy)
    float8 = torchao_float8()
    names = set(float8_layers(model))
    if not names:
        sizes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})[:4]
        raise ValueError(
            f"FSDP2Config(float8=True): no Linear layer of {type(model).__name__} is large enough for FP8 matmuls to "
            f"pay (torchao's {RECIPE} filter; weights {sizes}), the head aside. Train it without float8."
        )
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in names)
    log_rank0("float8: %d Linear layers train with FP8 matmuls (e.g. %s); the head stays bf16.", len(names), min(names))
    return sorted(names)


def refresh_float8_scales(model: nn.Module) -> None:
    """Before each training forward of the sharded `model`, compute every FP8 weight's scale once (one all-reduce of
    all their amaxes: torchao's `precompute_float8_dynamic_scale_for_fsdp`), from the weights as they are then.

    Without it torchao computes each weight's scale at each all-gather (forward and backward), one all-reduce per
    weight. Per forward rather than after each optimizer step: whatever changed the weights (the step, a checkpoint
    load, a user), the scales are theirs. A forward without gradients (evaluation, generation) clears them instead,
    and torchao computes each scale as it gathers.

    NOTE: a collective in the root's forward pre-hook; every rank runs the same forwards, in the same mode.
    """
    torchao_float8()
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]

    @torch.compiler.disable(recursive=True, reason="hf_fsdp2's float8 scale refresh runs eagerly, as FSDP2's hooks do")
    def refresh(module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            precompute_float8_dynamic_scale_for_fsdp(module)
            return
        for layer in layers:
            if isinstance(layer.weight, DTensor):  # a unit still gathered (the last block after a forward) has none
                layer.weight._local_tensor._precomputed_scale = None  # where torchao's precompute puts it

    model.register_forward_pre_hook(refresh)
