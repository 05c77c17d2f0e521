"""Values of the tensors no checkpoint holds (a new head, RoPE buffers, PEFT adapters): drawn as one process's
`from_pretrained` (and peft) would draw them, from the RNG state the skeleton was built with, identical on every
rank; adapter values already loaded into the skeleton are taken as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..adapters.methods import replayed_adapter_values
from ..adapters.trainable_tokens import checkpoint_row_reader, initial_token_values
from ..distributed import broadcast_from_rank0
from .facts import facts_of, unwrap_peft
from .safetensors_route import SafetensorsPlan
from .skeleton import build_skeleton, get_tensor, is_pretrained_model, loaded_values, set_tensor

_INIT_FLAG = "_is_hf_initialized"


def skeleton_rng_state(model: nn.Module) -> torch.Tensor:
    """Rank 0's RNG state as of the skeleton's creation (or now, for an object): every rank draws the same.

    NOTE: collective; every rank must call it.
    """
    source = facts_of(model).source
    state = source.rng_state if source is not None and source.rng_state is not None else torch.random.get_rng_state()
    return broadcast_from_rank0(state)


@contextlib.contextmanager
def rng_state(state: torch.Tensor) -> Iterator[None]:
    """Draw from `state` inside, and leave the caller's RNG (training's) as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.random.set_rng_state(state)
        yield


def initial_values(model: nn.Module, plan: SafetensorsPlan, state: torch.Tensor) -> dict[str, torch.Tensor]:
    """Full values of everything the checkpoint lacks, drawn as one process's from_pretrained (+ peft) would."""
    facts = facts_of(model)
    if not facts.is_peft:
        values_loaded_into_skeleton(model)  # refuses any: a plain model's tensors all come from the checkpoint
        with rng_state(state):
            return init_missing(model, plan.missing)
    source = facts.source
    kept = values_loaded_into_skeleton(model)
    # Adapter buffers outside the state dict too (VeRA's projections with save_projection=False): no checkpoint
    # holds them either, and peft computes them.
    adapters = [*plan.adapters, *(n for n in _non_persistent_buffers(model) if facts.is_adapter(n))]
    replay = [n for n in adapters if get_tensor(model, n).is_meta and n not in kept]
    given = {n: kept.get(n, get_tensor(model, n)).detach().cpu() for n in adapters if n not in replay}
    with rng_state(state):
        # A PEFT model's base is initialized as the unwrapped model it was built from, then its adapters.
        pristine = build_skeleton(source.path, source.auto_class, source.kwargs)
        base_values = init_missing(pristine, sorted({facts.base_name(n) for n in plan.missing}))
        values = replayed_adapter_values(model, pristine, replay) if replay else {}
    for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if facts.base_name(name) in base_values and not facts.is_adapter(name):
            values[name] = base_values[facts.base_name(name)]
    # peft copies the base rows of trainable_token_indices; the replay read zeros there, the checkpoint has them.
    values.update(initial_token_values(model, checkpoint_row_reader(source.path, plan.keys)))
    # Adapters with values (e.g. loaded by PeftModel.from_pretrained) are rank 0's on every rank.
    values.update(broadcast_from_rank0(given) if given else {})
    return values


def values_loaded_into_skeleton(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter values `load_state_dict` put into a skeleton's meta tensors (`PeftModel.from_pretrained` on
    `hf_fsdp2.from_pretrained`'s skeleton), by `model`'s own names.

    Raises:
        ValueError: when a base tensor was given a value that way: the base is read from its checkpoint.
    """
    facts = facts_of(model)
    skeleton = unwrap_peft(model)
    kept = loaded_values(skeleton)
    if not kept:
        return {}
    under_skeleton = dict([*skeleton.named_parameters(remove_duplicate=False), *skeleton.named_buffers()])
    by_id = {id(under_skeleton[name]): value for name, value in kept.items() if name in under_skeleton}
    values = {
        name: by_id[id(tensor)]
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        if id(tensor) in by_id
    }
    base = [name for name in values if not facts.is_adapter(name)]
    if base:
        raise ValueError(
            f"{base[0]}: a value was loaded into the meta skeleton of hf_fsdp2.from_pretrained (load_state_dict); "
            f"its base weights are read from {facts.source.path if facts.source else 'the checkpoint'} when the "
            "model is sharded. Load base weights after sharding (trainer.model), or pass a model object with real "
            "weights."
        )
    return values


def init_missing(model: nn.Module, missing: list[str]) -> dict[str, torch.Tensor]:
    """Initialize what the checkpoint lacks exactly as single-process `from_pretrained` would.

    Every rank runs this with the same seed, so every rank computes the same full values. Only the missing
    tensors get storage; everything else stays on meta and is flagged as loaded, so `initialize_weights`
    draws random numbers for the same tensors, in the same order, as `from_pretrained`.

    Raises:
        ValueError: when `model` is not a PreTrainedModel but has missing tensors or non-persistent buffers.
    """
    buffers = _non_persistent_buffers(model)
    if not missing and not buffers:
        return {}
    if not is_pretrained_model(model):
        raise ValueError(
            f"{type(model).__name__} is not a PreTrainedModel, so nothing can initialize {(missing + buffers)[0]}; "
            "pass a model object with real weights instead."
        )
    groups = facts_of(model).tie_map
    todo = set(missing) | set(buffers)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name not in todo:
            setattr(tensor, _INIT_FLAG, True)
    for name in todo:
        _set_storage(model, groups.get(name, [name]), "cpu")
    model.initialize_weights()
    values = {name: get_tensor(model, name).detach() for name in todo}
    for name in todo:
        _set_storage(model, groups.get(name, [name]), "meta")
    _clear_init_flags(model)
    return values


def _non_persistent_buffers(model: nn.Module) -> list[str]:
    """Names of buffers that no checkpoint holds (RoPE inv_freq and friends)."""
    return [
        f"{module_name}.{leaf}" if module_name else leaf
        for module_name, module in model.named_modules()
        for leaf in module._non_persistent_buffers_set
        if module._buffers.get(leaf) is not None
    ]


def _set_storage(model: nn.Module, names: list[str], device: str) -> None:
    """Give a (possibly tied) parameter or buffer fresh storage on `device`, keeping its dtype and tie."""
    old = get_tensor(model, names[0])
    new = torch.empty_like(old, device=device)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    set_tensor(model, names, new)


def _clear_init_flags(model: nn.Module) -> None:
    """Remove transformers' init flags so a later `initialize_weights` is not silently skipped."""
    for module in model.modules():
        module.__dict__.pop(_INIT_FLAG, None)
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                tensor.__dict__.pop(_INIT_FLAG, None)
