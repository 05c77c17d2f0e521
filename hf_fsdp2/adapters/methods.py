"""PEFT adapters (LoRA and friends) on a model that will be sharded: which tensors are adapters, which
checkpoint tensor fills each base tensor, and adapter values on a meta skeleton exactly as peft makes them.

peft puts the adapters of a meta skeleton on the meta device too, after drawing their random values. To
get those values back without holding the base model, peft's own `get_peft_model` is run again, from the
skeleton's RNG state, on a stand-in whose every tensor is one element expanded to its shape; and once more, from
the same RNG state, on a stand-in with other values: an adapter whose values differ between the two was computed
from the base weights (PiSSA, MiCA, DoRA's magnitudes, ...), which a skeleton does not have, and is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .trainable_tokens import rows_read_from_the_checkpoint

# Seed of the varied stand-in's values: any values other than the zero stand-in's do (a fixed seed keeps it repeatable).
_STANDIN_SEED = 0


def is_peft_model(model: nn.Module) -> bool:
    """True for a `peft.PeftModel` (what `get_peft_model` and `PeftModel.from_pretrained` return)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_tensor_names(model: nn.Module) -> frozenset[str]:
    """Every name (aliases included) of the tensors that are adapter state by peft's own account, so that no
    method peft ships needs a case here: what `get_peft_model_state_dict` holds for some adapter (VeRA's shared
    projections, DoRA's magnitudes), or what is not a tensor of `get_base_model()` (prompt encoders).

    The trained copies of `modules_to_save` are left out: they start as copies of base weights, which the base
    checkpoint holds under the original's name (see `base_spellings`).
    """
    saved, base = _saved_tensor_ids(model), {id(t) for _, t in _named_tensors(model.get_base_model())}
    copies = {id(t) for _, t in _named_tensors(_copies_of_base(model))}
    return frozenset(
        name for name, t in _named_tensors(model) if (id(t) in saved or id(t) not in base) and id(t) not in copies
    )


def untracked_trainable(model: nn.Module) -> str | None:
    """The first trainable parameter that is in no adapter's state (adapter-only checkpoints would lose it), or None."""
    saved, base = _saved_tensor_ids(model), {id(t) for _, t in _named_tensors(model.get_base_model())}
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in saved and id(param) in base:
            return name
    return None


def _saved_tensor_ids(model: nn.Module) -> set[int]:
    """Identities of the live tensors that peft's state dict of each adapter holds.

    Prompt-learning adapters are skipped: peft saves their encoder's output (computed, not a live tensor), and
    the encoder is not part of the base model anyway.
    """
    from peft import get_peft_model_state_dict

    state = model.state_dict(keep_vars=True)
    return {
        id(tensor)
        for adapter, config in model.peft_config.items()
        if not config.is_prompt_learning
        for tensor in get_peft_model_state_dict(
            model, state_dict=state, adapter_name=adapter, save_embedding_layers=False
        ).values()
    }


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers (non-persistent ones too) under every name they have."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _copies_of_base(model: nn.Module) -> nn.Module:
    """The trained copies that peft's `ModulesToSaveWrapper`s hold, as one module."""
    from peft.utils import ModulesToSaveWrapper

    return nn.ModuleList(m.modules_to_save for m in model.modules() if isinstance(m, ModulesToSaveWrapper))


def prompt_encoders(model: nn.Module) -> list[nn.Module]:
    """The prompt encoders of a PEFT model's prompt-learning adapters (prompt/prefix tuning, p-tuning)."""
    if not is_peft_model(model):
        return []
    encoders = getattr(model, "prompt_encoder", {})
    return [encoders[name] for name, config in model.peft_config.items() if config.is_prompt_learning]


def base_root(model: nn.Module) -> str:
    """Where `get_base_model()` sits in a PEFT model: `base_model.model` under a tuner, `base_model` for prompt
    learning (which has no tuner wrapper)."""
    base = model.get_base_model()
    return next(name for name, module in model.named_modules() if module is base)


def check_supported(model: nn.Module) -> None:
    """Refuse PEFT methods whose training reads whole adapter matrices outside forward, which a rank never holds.

    Raises:
        ValueError: for AdaLoRA, naming why and what to use instead.
    """
    for adapter, config in model.peft_config.items():
        if config.peft_type.value == "ADALORA":
            raise ValueError(
                f"adapter {adapter!r} is AdaLoRA, which hf_fsdp2 does not train: its orthogonal regulariser (added to "
                "the loss in forward) and update_and_allocate (rank pruning after each step) read whole lora_A, lora_B "
                "and lora_E matrices, but FSDP2 gives each rank a slice of them; and with several ranks Trainer would "
                "count the regulariser once per rank. Use LoRA instead: LoraConfig(r=...), with use_rslora=True "
                "(rsLoRA) or use_dora=True (DoRA) for a variant."
            )


def base_spellings(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """Each name of each tensor under a PEFT model's base model → the base model's own name for it, and which copy it
    is: None for a tensor of the base, "" for the original a `ModulesToSaveWrapper` keeps, else the adapter whose
    trained copy it is (a copy is named like the original it was copied from).

    Asked of peft's layers, not read from names: a tuner layer (`BaseTunerLayer`) and an auxiliary training wrapper
    (modules_to_save, trainable tokens) each say which module they wrap (`get_base_layer()`, `original_module`), and a
    modules_to_save wrapper holds its copies in `modules_to_save`. So a base model's own module called
    `original_module`, `modules_to_save` or `token_adapter` keeps its name (a rule on name segments would drop it).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.other import AuxiliaryTrainingWrapper

    found: dict[str, tuple[str, str | None]] = {}

    def join(prefix: str, leaf: str) -> str:
        return f"{prefix}.{leaf}" if prefix else leaf

    def wrapped(module: nn.Module) -> nn.Module | None:
        if isinstance(module, BaseTunerLayer):
            return module.get_base_layer()
        return module.original_module if isinstance(module, AuxiliaryTrainingWrapper) else None

    def visit(module: nn.Module, name: str, base: str, copy: str | None) -> None:
        for leaf, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                found[join(name, leaf)] = (join(base, leaf), copy)
        inner = wrapped(module)
        for leaf, child in module._modules.items():
            if child is None:
                continue
            wraps_inner = inner is not None and (child is inner or wrapped(child) is inner)  # a layer or a tuner on it
            if isinstance(module, ModulesToSaveWrapper) and child is module.modules_to_save:
                for adapter, trained in child.items():
                    visit(trained, join(join(name, leaf), adapter), base, adapter)
            elif wraps_inner:
                original = isinstance(module, ModulesToSaveWrapper) and copy is None
                visit(child, join(name, leaf), base, "" if original else copy)
            else:
                visit(child, join(name, leaf), join(base, leaf), copy)

    visit(model.get_base_model(), base_root(model), "", None)
    return found


def check_replayable(model: nn.Module, base: nn.Module) -> None:
    """Raise ValueError when an adapter's initial values depend on base weights a skeleton does not have.

    `base` is a meta skeleton of the unwrapped model (it is used up). Call under the RNG state peft drew from.

    Raises:
        ValueError: when replaying peft's init on two different stand-ins of the base weights gives different
            adapter values (or fails on them).
    """
    _replay_checked(model, base)


def _replay_checked(model: nn.Module, base: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors (by name) of `model`'s adapters replayed on the zero stand-in of `base`, after checking that a
    replay from the same RNG state on a varied stand-in gives the same values: no deny-list of inits to keep up.

    NOTE: the second replay costs what peft's own adapter init costs (the adapters only: the base stand-ins hold one
    element, or sum(shape) elements, per tensor). On an 8.9B-parameter Llama skeleton with LoRA r=16 on every block
    linear: 1.56 s for one replay, 2.38 s for the checked pair, 952 MiB max RSS in all (CPU, one process;
    scripts/measure/measure_adapter_replay.py, scripts/results/adapter_replay.json). A weight-dependent init does its
    own work (PiSSA's SVDs) on the stand-ins twice before it is refused.
    """
    state = torch.random.get_rng_state()
    spare = copy.deepcopy(base)  # meta tensors: nothing is copied but the structure
    first = _replayed_tensors(base, model, _standin)
    after = torch.random.get_rng_state()
    torch.random.set_rng_state(state)
    try:
        second = _replayed_tensors(spare, model, _varied_standin)
    finally:
        torch.random.set_rng_state(after)  # the caller's RNG goes on as after one replay
    # NOTE: trainable tokens' base rows differ between the stand-ins by design; they are read from the checkpoint.
    for name in sorted(adapter_tensor_names(model) - rows_read_from_the_checkpoint(model)):
        value, other = first.get(name), second.get(name)
        if value is not None and not (other is not None and value.shape == other.shape and torch.equal(value, other)):
            adapter = next((a for a in model.peft_config if a in name.split(".")), next(iter(model.peft_config)))
            raise ValueError(
                f"adapter {adapter!r} uses {_init_settings(model.peft_config[adapter])} and its initial {name} is "
                "computed from the base weights (replaying peft's initialization on two different stand-ins of them "
                "gave different values), but the base model is a meta skeleton. Build the base with real weights "
                "(AutoModel.from_pretrained) before get_peft_model, or use the default initialization."
            )
    return first


def _replayed_tensors(base: nn.Module, model: nn.Module, standin: Any) -> dict[str, torch.Tensor]:
    """Every tensor of `model`'s adapters replayed on `base` with each base tensor replaced by `standin(tensor)`.

    Raises:
        ValueError: when peft's init fails on the stand-ins (an init that writes into the base weights does).
    """
    try:
        replayed = replay_adapters(_weightless(base, standin), model)
    except Exception as error:
        raise ValueError(
            f"peft's initialization of the adapters failed on stand-ins of the base weights ({type(error).__name__}: "
            f"{error}): it reads or writes the base weights, but the base model is a meta skeleton. Build the base "
            "with real weights (AutoModel.from_pretrained) before get_peft_model, or use the default initialization."
        ) from error
    return {**dict(replayed.named_parameters()), **dict(replayed.named_buffers())}


def _init_settings(config: Any) -> str:
    """The initialization settings of an adapter config that differ from peft's defaults, for an error message."""
    defaults = (("init_lora_weights", True), ("use_dora", False), ("prompt_tuning_init", "RANDOM"))
    found = [
        f"{field}={str(getattr(value, 'value', value)) if isinstance(value, str) else value!r}"
        for field, default in defaults
        if (value := getattr(config, field, default)) != default
    ]
    return ", ".join(found) or "its default initialization"


def replay_adapters(base: nn.Module, model: nn.Module) -> nn.Module:
    """Wrap `base` with `model`'s adapters, calling peft as the user did (first adapter, then the others)."""
    from peft import get_peft_model

    configs = list(model.peft_config.items())
    name, config = configs[0]
    replayed = get_peft_model(base, copy.deepcopy(config), adapter_name=name)
    for name, config in configs[1:]:
        replayed.add_adapter(name, copy.deepcopy(config))
    return replayed


def _standin(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of `tensor`'s shape and dtype backed by one element: peft reads device and dtype only."""
    return torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)


def _varied_standin(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of `tensor`'s shape and dtype whose element (i, j, ...) is v[i + j + ...] for a random v: every
    row and column differs (a weight-dependent init cannot land on the zero stand-in's values by symmetry), backed by
    sum(shape) elements, drawn from a generator of its own so the RNG peft draws from is untouched."""
    length = sum(size - 1 for size in tensor.shape) + 1
    generator = torch.Generator().manual_seed(_STANDIN_SEED)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        values = torch.randn(length, generator=generator).to(tensor.dtype)
    else:
        values = torch.ones(length, dtype=tensor.dtype)
    return values.as_strided(tensor.shape, (1,) * tensor.ndim)


def _weightless(model: nn.Module, standin: Any = _standin) -> nn.Module:
    """Replace every meta parameter and buffer of `model` with `standin` of it (by default one element) on the CPU."""
    for module in model.modules():
        for leaf, param in module._parameters.items():
            if param is not None:
                module._parameters[leaf] = nn.Parameter(standin(param), requires_grad=param.requires_grad)
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = standin(buffer)
    return model


def replayed_adapter_values(model: nn.Module, base: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The values peft gave the adapter tensors `names` of a skeleton-based `model` (call under the skeleton's RNG).

    `base` is a fresh meta skeleton of the unwrapped model; it is turned into the stand-in peft runs on.

    Raises:
        ValueError: when an adapter's init depends on base weights (`check_replayable`), or the replay gives another
            shape or dtype.
    """
    values = _replay_checked(model, base)
    wanted = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        value, expected = values.get(name), wanted[name]
        if value is None or value.shape != expected.shape or value.dtype != expected.dtype:
            raise ValueError(
                f"could not reproduce peft's initialization of {name} (got {_describe(value)}, the model has "
                f"{_describe(expected)}): the adapters were not added with get_peft_model/add_adapter defaults "
                "(autocast_adapter_dtype?). Build the base with real weights before adding adapters."
            )
        out[name] = value.detach().clone()
    return out


def _describe(tensor: torch.Tensor | None) -> str:
    return "nothing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"


def active_adapter(model: nn.Module) -> str:
    """The one active adapter (merging and exporting several at once is ambiguous).

    Raises:
        ValueError: when no adapter or more than one adapter is active.
    """
    active: Any = model.active_adapter
    names = [active] if isinstance(active, str) else list(active)
    if len(names) != 1:
        raise ValueError(f"{len(names)} adapters are active ({names}); activate one with model.set_adapter(name).")
    return names[0]
