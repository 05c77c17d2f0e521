"""The model's structure without its weights: meta-device skeletons, where their weights live, tied
parameters and the tensor surgery that keeps ties intact.

It reads configs, never weights; where the weights come from is `loading.weights`' business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SOURCE_ATTR = "_hf_fsdp2_source"
LOADED_ATTR = "_hf_fsdp2_loaded"  # {name under the skeleton: value} that load_state_dict put into its meta tensors
# from_pretrained kwargs that shape the model object rather than its config.
_MODEL_KWARGS = ("dtype", "torch_dtype", "attn_implementation", "trust_remote_code")


@dataclass
class PretrainedSource:
    """Where a skeleton's weights live, and how `from_pretrained` would have been called."""

    path: str
    auto_class: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The CPU RNG state when the skeleton was built: weights the checkpoint lacks (and PEFT adapters added
    # afterwards) are initialized from it, drawing the same numbers as a real from_pretrained at that point.
    rng_state: torch.Tensor | None = None
    # "nf4" when from_pretrained was given a 4-bit BitsAndBytesConfig (the base is quantized while sharding).
    quantization: str | None = None


def from_pretrained(path: str | os.PathLike, auto_class: Any = None, **kwargs: Any) -> nn.Module:
    """Build `auto_class.from_pretrained(path, **kwargs)`'s model on the meta device, reading no weights.

    `FSDP2Trainer` loads each rank's part of the weights after sharding. Keyword arguments are those of
    `from_pretrained` (`dtype`, `attn_implementation`, `trust_remote_code`, config overrides such as
    `num_labels`). Without `auto_class`: `AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a
    vision-language model, or `AutoModelForSeq2SeqLM` for an encoder-decoder (T5, BART): the first that takes
    the config.
    """
    path = os.fspath(path)
    rng_state = torch.random.get_rng_state()
    quantization = four_bit_quantization(kwargs)
    if auto_class is None:
        auto_class = default_auto_class(path, kwargs.get("trust_remote_code", False))
    model = build_skeleton(path, auto_class, kwargs)
    setattr(model, SOURCE_ATTR, PretrainedSource(path, auto_class, dict(kwargs), rng_state, quantization))
    setattr(model, LOADED_ATTR, {})
    model.register_load_state_dict_pre_hook(_keep_values_loaded_into_meta)
    return model


def _keep_values_loaded_into_meta(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Keep a copy of each value `load_state_dict` puts into one of the skeleton's meta tensors.

    NOTE: torch makes such a copy a no-op, so `PeftModel.from_pretrained(skeleton, adapter_dir)` kept none of the
    saved adapter's weights and sharding initialized them afresh; `loading` takes the kept values instead.
    """
    kept = getattr(module, LOADED_ATTR)
    for key, value in state_dict.items():
        name = key[len(prefix) :]
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor) or value.is_meta:
            continue
        target = _tensor(module, name)
        if target is not None and target.is_meta:
            kept[name] = value.detach().to("cpu", copy=True)


def _tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer `name` of `model`, or None."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return module._parameters.get(leaf, module._buffers.get(leaf))


def loaded_values(skeleton: nn.Module) -> dict[str, torch.Tensor]:
    """What `load_state_dict` put into `skeleton`'s meta tensors, by name under the skeleton (see above)."""
    return getattr(skeleton, LOADED_ATTR, {})


def four_bit_quantization(kwargs: dict[str, Any]) -> str | None:
    """Take a `quantization_config` out of from_pretrained's kwargs: "nf4" for QLoRA's 4-bit NF4, else refuse.

    bitsandbytes' 4-bit NF4 becomes torchao's NF4 (the same format: 64-value blocks, double-quantized scalers),
    quantized while sharding. The base is read, and its NF4 weights dequantized, in from_pretrained's `dtype`
    when given, else in a compute dtype the user chose, else in the checkpoint's dtype (transformers' "auto"):
    bitsandbytes' default compute dtype (float32) would otherwise double a bf16 checkpoint's dense weights.

    Raises:
        ValueError: for any other quantization (8-bit, fp4, other methods), naming it.
    """
    config = kwargs.pop("quantization_config", None)
    if config is None:
        return None
    settings = config if isinstance(config, dict) else config.to_dict()
    method = settings.get("quant_method", "bitsandbytes")
    method = str(getattr(method, "value", method)).lower().replace("_", "")
    kind = str(settings.get("bnb_4bit_quant_type", "fp4")).lower()
    if method != "bitsandbytes" or not settings.get("load_in_4bit") or kind != "nf4":
        what = (
            "8-bit" if settings.get("load_in_8bit") else (f"4-bit {kind}" if settings.get("load_in_4bit") else method)
        )
        raise ValueError(
            f"quantization_config asks for {what} quantization; hf_fsdp2 shards 4-bit NF4 bases only (QLoRA): "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'), or FSDP2Config(base_quantization='nf4')."
        )
    compute = str(settings.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
    if compute != "float32" and "dtype" not in kwargs and "torch_dtype" not in kwargs:
        kwargs["dtype"] = compute
    return "nf4"


def default_auto_class(path: str, trust_remote_code: bool = False) -> Any:
    """The Auto class a path means when none is named: see `auto_class_for`."""
    from transformers import AutoConfig

    return auto_class_for(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def auto_class_for(config: Any) -> Any:
    """Causal LM, else image-text-to-text, else sequence-to-sequence LM: the first Auto class that maps `config`."""
    # NOTE: transformers' modeling classes are imported where used, not with this module: the offline
    # consolidation command imports this module and must start without them (see hf_fsdp2/__init__.py).
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    for auto_class in (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM):
        if type(config) in auto_class._model_mapping:
            return auto_class
    return AutoModelForCausalLM  # its own error names the config class and the ones it takes


def build_skeleton(path: str, auto_class: Any, kwargs: dict[str, Any]) -> nn.Module:
    """The meta-device model `from_pretrained(path, auto_class, **kwargs)` describes (no source attached)."""
    from transformers import AutoConfig

    model_kwargs = {k: kwargs[k] for k in _MODEL_KWARGS if k in kwargs}
    config_kwargs = {k: v for k, v in kwargs.items() if k not in (*_MODEL_KWARGS, "config") or k == "trust_remote_code"}
    # A config object passed in (from_pretrained's `config=`) is used as it is, as from_pretrained would.
    config = kwargs.get("config") or AutoConfig.from_pretrained(path, **config_kwargs)
    legacy_dtype = model_kwargs.pop("torch_dtype", None)
    dtype = model_kwargs.pop("dtype", None) or legacy_dtype or "auto"
    if dtype == "auto":
        # Same default as transformers 5's from_pretrained: the dtype the checkpoint was saved in.
        dtype = config.dtype or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # Auto classes build with `from_config`; a concrete class (`LlamaForSequenceClassification`) with `_from_config`,
    # what transformers' own Auto classes call on it once they resolved any remote code.
    build = getattr(auto_class, "from_config", None)
    if build is None:
        build = auto_class._from_config
        model_kwargs.pop("trust_remote_code", None)
    with torch.device("meta"):
        return build(config, dtype=dtype, **model_kwargs)


def get_source(model: nn.Module) -> PretrainedSource | None:
    """Return where a skeleton built by `from_pretrained` reads its weights, or None for a model object."""
    return getattr(model, SOURCE_ATTR, None)


def tie_groups(model: nn.Module) -> list[list[str]]:
    """List the names that share one Parameter object, one list per shared parameter (first name first)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def is_pretrained_model(model: nn.Module) -> bool:
    """isinstance(model, PreTrainedModel), importing transformers' modeling code only when asked: the offline
    consolidation command imports this module and must start without it (see hf_fsdp2/__init__.py)."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` of `model` (AttributeError when it has neither)."""
    module_name, _, leaf = name.rpartition(".")
    is_param = leaf in model.get_submodule(module_name)._parameters
    return model.get_parameter(name) if is_param else model.get_buffer(name)


def set_tensor(model: nn.Module, names: list[str], tensor: torch.Tensor) -> None:
    """Put one tensor (Parameter or buffer) under every name of a tie group, keeping the tie."""
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf in module._parameters:
            module._parameters[leaf] = tensor
        else:
            module._buffers[leaf] = tensor


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name in each group point at the group's first Parameter again."""
    for names in groups:
        set_tensor(model, names[1:], model.get_parameter(names[0]))


def move_to_meta(model: nn.Module, groups: list[list[str]]) -> None:
    """Drop every parameter's and buffer's storage, keeping shapes, dtypes and the tie `groups`."""
    model.to("meta")
    # NOTE: Module._apply gives each owner of a shared Parameter its own new Parameter; tie them again.
    retie(model, groups)


def first_meta_tensor(model: nn.Module) -> str | None:
    """Name the first parameter or buffer still on the meta device, or None."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta or (hasattr(tensor, "to_local") and tensor.to_local().is_meta):
            return name
    return None
