"""Turning a model into FSDP2 units: which modules to wrap, activation checkpointing, compile,
mixed precision and `fully_shard`, bottom-up with the root last.

It works on meta or real tensors alike and never reads weights or touches the Trainer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from ..adapters.methods import prompt_encoders
from ..adapters.nf4 import is_nf4
from ..config import WRAP_POLICIES, FSDP2Config, resolve_dtype
from ..distributed import alone, log_rank0, warn_rank0
from ..loading.branches import branch_names, inside_branch
from ..loading.facts import facts_of
from ..loading.skeleton import set_tensor
from ..meshes import world_group
from .comm_buffers import pool_comm_buffers
from .inference_mode import allow_inference_mode

# Set on each block FSDP2Config(compile=True) compiled, so generate can run those (and only those) eagerly.
COMPILED_BY_US = "_hf_fsdp2_compiled"


def block_classes(model: nn.Module, config: FSDP2Config) -> list[str]:
    """Return the block class names to wrap: the config's, else the model's `_no_split_modules` (maybe none)."""
    if config.transformer_layer_cls_to_wrap:
        return list(config.transformer_layer_cls_to_wrap)
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or []:
            if name not in names:
                names.append(name)
    return names


def _splits_a_tie(module: nn.Module, groups: list[set[int]]) -> bool:
    """True when `module` owns some but not all users of a shared parameter (they must share a unit)."""
    owned = {id(m) for m in module.modules()}
    return any(0 < len(owned & group) < len(group) for group in groups)


def _tie_owner_groups(model: nn.Module) -> list[set[int]]:
    """For each shared parameter, the ids of the modules that hold it."""
    groups = facts_of(model).tie_groups
    return [{id(model.get_submodule(name.rpartition(".")[0])) for name in names} for names in groups]


def _size_based_units(model: nn.Module, min_num_params: int, groups: list[set[int]]) -> list[nn.Module]:
    """Pick, bottom-up, the smallest modules holding >= min_num_params parameters not yet in a unit."""
    units: list[nn.Module] = []
    covered: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        fresh = [p for p in module.parameters() if id(p) not in covered]
        if sum(p.numel() for p in fresh) >= min_num_params and not _splits_a_tie(module, groups):
            units.append(module)
            covered.update(id(p) for p in fresh)

    visit(model)
    return units


def select_units(model: nn.Module, config: FSDP2Config) -> list[nn.Module]:
    """Return the modules to shard as their own units, deepest first (the root is always sharded last).

    Nothing inside a branch (a module some ranks may skip: `branches`) becomes a unit: it stays in the root.

    Raises:
        ValueError: when the wrap policy is unknown, named block classes match nothing, or a unit splits a tie.
    """
    # A prompt encoder is a unit of its own: peft computes the prompt it saves by calling the encoder outside the
    # model's forward, and as a unit its forward gathers its (small) weights, and nothing of the frozen base.
    units = _policy_units(model, config) + prompt_encoders(model)
    branches = branch_names(model, facts_of(model).branches[0], config.branch_modules)
    if not branches:
        return units
    names = {id(m): n for n, m in model.named_modules()}
    kept = [u for u in units if not inside_branch(names[id(u)], branches)]
    log_rank0(
        "Kept %s in the root unit (%d blocks inside not sharded on their own): a rank may skip them in a step "
        "(a text-only batch), and every rank must run the same collectives.",
        ", ".join(branches),
        len(units) - len(kept),
    )
    return kept


def _policy_units(model: nn.Module, config: FSDP2Config) -> list[nn.Module]:
    """The units the wrap policy picks."""
    groups = _tie_owner_groups(model)
    policy = config.auto_wrap_policy
    if callable(policy):
        units = [m for m in _post_order(model) if m is not model and policy(m)]
    else:
        match policy:
            case "no_wrap":
                return []
            case "size_based_wrap":
                return _size_based_units(model, config.min_num_params, groups)
            case "transformer_based_wrap":
                units = _block_units(model, config, groups)
            case _:
                raise ValueError(f"auto_wrap_policy={policy!r}; choose one of {list(WRAP_POLICIES)} or a callable")
    for unit in units:
        if _splits_a_tie(unit, groups):
            raise ValueError(
                f"wrapping {type(unit).__name__} would split tied weights across FSDP units; tied embedding and "
                "head must share a unit. Exclude it from the wrap policy."
            )
    return units


def _block_units(model: nn.Module, config: FSDP2Config, groups: list[set[int]]) -> list[nn.Module]:
    """The blocks `transformer_based_wrap` names; without declared blocks, size-based units (maybe none).

    Only an explicit `transformer_layer_cls_to_wrap` that matches nothing is an error: a model that declares
    no blocks (a plain nn.Module, a custom PreTrainedModel) trains with plain Trainer, so it must train here.
    """
    wanted = block_classes(model, config)
    units = [m for m in _post_order(model) if type(m).__name__ in wanted and m is not model]
    if units:
        return units
    present = sorted({type(m).__name__ for m in model.modules()})
    if config.transformer_layer_cls_to_wrap:
        raise ValueError(f"no module matched transformer_layer_cls_to_wrap={wanted}; classes in this model: {present}")
    units = _size_based_units(model, config.min_num_params, groups)
    why = f"declares blocks {wanted} that it does not contain" if wanted else "declares no `_no_split_modules`"
    chosen = f"{len(units)} size-based units" if units else "one unit, the whole model"
    log_rank0(
        "%s %s, so FSDP2 units are chosen by size (min_num_params=%s): %s. Name the block classes with "
        "FSDP2Config(transformer_layer_cls_to_wrap=[...]) to shard block by block.",
        type(model).__name__,
        why,
        f"{config.min_num_params:,}",
        chosen,
    )
    return units


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Modules children-first, so inner units are sharded before the units that contain them."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def mixed_precision_policy(config: FSDP2Config, bf16: bool, fp16: bool) -> MixedPrecisionPolicy:
    """Resolve compute and reduce dtypes from the config, defaulting from TrainingArguments' bf16 or fp16.

    fp16 compute trains with a gradient scaler (the trainer's `AgreedGradScaler`); the masters stay fp32 and
    gradients are reduced in fp32, as under bf16.

    Raises:
        ValueError: when bf16 and fp16 are both set, or fp16 with another `param_dtype`.
    """
    if bf16 and fp16:
        raise ValueError("TrainingArguments(bf16=True, fp16=True): choose one compute dtype (bf16 where GPUs have it).")
    if fp16 and config.param_dtype not in (None, "float16"):
        raise ValueError(
            f"TrainingArguments(fp16=True) with FSDP2Config(param_dtype={config.param_dtype!r}): fp16 means float16 "
            "compute. Leave param_dtype unset, or drop fp16=True to compute in that dtype."
        )
    default = "bfloat16" if bf16 else "float16" if fp16 else None
    param_dtype = resolve_dtype(config.param_dtype or default)
    reduce_name = config.reduce_dtype or ("float32" if param_dtype not in (None, torch.float32) else None)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=resolve_dtype(reduce_name))


def upcast_trainable(model: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Make trainable low-precision params fp32 masters when compute runs in a lower precision."""
    if policy.param_dtype in (None, torch.float32):
        return
    facts = facts_of(model)
    groups = {id(model.get_parameter(names[0])): names for names in facts.tie_groups}
    upcast: list[str] = []
    for name, param in list(model.named_parameters()):
        if param.requires_grad and param.dtype != torch.float32:
            master = nn.Parameter(param.detach().to(torch.float32), requires_grad=True)
            set_tensor(model, groups.get(id(param), [name]), master)
            facts.upcast_from.update(dict.fromkeys(groups.get(id(param), [name]), param.dtype))
            upcast.append(name)
    if upcast:
        warn_rank0(
            "Upcast %d trainable parameters (e.g. %s) to float32 master weights; compute runs in %s. "
            "Set FSDP2Config(param_dtype='float32') to train in float32 throughout.",
            len(upcast),
            upcast[0],
            policy.param_dtype,
        )


def _check_reshard(value: bool | int, mesh: DeviceMesh) -> None:
    """An int reshard size must divide the shard group, or FSDP fails deep inside."""
    shard_size = mesh.size(-1)
    if not isinstance(value, bool) and shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} does not divide the shard group size {shard_size}; "
            f"use True, False or a divisor of {shard_size}."
        )


def scalar_parameters(model: nn.Module) -> list[nn.Parameter]:
    """0-dim parameters (CLIP's `logit_scale`, scale heads): `fully_shard` cannot split them.

    They stay whole on every rank, outside FSDP (`ignored_params`), and `reduce_scalar_gradients`
    averages their gradients the way FSDP averages everyone else's.
    """
    return [p for p in model.parameters() if p.ndim == 0]


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    config: FSDP2Config,
    policy: MixedPrecisionPolicy,
    units: list[nn.Module] | None = None,
) -> nn.Module:
    """Apply activation checkpointing, then compile, then `fully_shard` to each unit and the root."""
    units = select_units(model, config) if units is None else units
    _check_reshard(config.reshard_policy, mesh)
    if config.fsdp_activation_checkpointing:
        _checkpoint_units(model, units)
    if config.compile:
        for unit in units or [model]:
            unit.compile()
            setattr(unit, COMPILED_BY_US, True)  # generate runs it eagerly (collective_methods.eager_blocks)
    kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=config.reshard_policy, mp_policy=policy)
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    ignored = set(scalar_parameters(model))
    if mesh.size(mesh.ndim - 1) == 1:
        # NOTE: with one shard FSDP2 (torch 2.13) skips the all-gather and hands NF4's gather hook a single
        # tensor; frozen NF4 weights then stay whole outside FSDP, as they would be anyway.
        ignored |= {p for p in model.parameters() if is_nf4(p)}
    if ignored:
        kwargs["ignored_params"] = ignored
    trains = any(p.requires_grad for p in model.parameters())
    # The last block is the first backward needs: resharding it after forward only buys an all-gather of it
    # right back (torchtitan's default too). It stays gathered over the loss instead: one block's full weights,
    # within the plan's two gathered blocks. "Last" is by module order, forward order in the models we know.
    # Measured (12-layer benchmark Llama, 2 CPU ranks, 5 interleaved runs of 10 steps): step 2.62 -> 2.53 s.
    blocks = [unit for unit in units if not any(unit is encoder for encoder in prompt_encoders(model))]
    last = _last_in_module_order(model, blocks) if trains and config.reshard_policy is True else None
    for unit in units:
        fully_shard(unit, **({**kwargs, "reshard_after_forward": False} if unit is last else kwargs))
    # The root's parameters (embedding, final norm, a tied head) are the last used in forward and the first
    # in backward: resharding them after forward only buys a second all-gather. None is torch's rule for the
    # root: keep them gathered until backward (measured: the 12-layer benchmark's steps were 1.2x slower).
    # A model with nothing to train (a DPO reference) never runs backward, so its root reshards at once.
    fully_shard(model, **{**kwargs, "reshard_after_forward": None if trains else True})
    allow_inference_mode(model)  # TRL scores reward models under torch.inference_mode()
    if mesh.device_type == "cpu":
        # Measured (1.2B Llama, 2 CPU ranks, one profiled step each): page faults 36-42 -> 24-28 GiB per rank
        # per step, copy_ 15.9 -> 9.8 s and cat 2.5 -> 0.5 s of CPU time; see sharding/comm_buffers.py.
        pool_comm_buffers(model)
    if hasattr(model, "generate"):
        # NOTE: generate() reads root params outside forward; this makes it gather them first.
        register_fsdp_forward_method(model, "generate")
    return model


def _last_in_module_order(model: nn.Module, units: list[nn.Module]) -> nn.Module | None:
    """The unit registered last: the block whose forward ends last and whose backward comes first."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    return max(units, key=lambda unit: order[id(unit)], default=None)


def reduce_scalar_gradients(model: nn.Module) -> None:
    """Average each 0-dim parameter's gradient over all ranks as it is produced, as FSDP does for the rest.

    NOTE: a collective inside backward; every rank's graph uses the same scalars in the same order.
    """
    if alone():
        return
    world = dist.get_world_size()
    group = world_group()  # with CPU offload a scalar's gradient can be a CPU tensor

    def average(grad: torch.Tensor) -> torch.Tensor:
        total = grad.detach().clone()
        dist.all_reduce(total, group=group)
        return total.div_(world)

    for param in scalar_parameters(model):
        if param.requires_grad:
            param.register_hook(average)


def _checkpoint_units(model: nn.Module, units: list[nn.Module]) -> None:
    """Recompute each unit's activations in backward; composable, so parameter names stay the same."""
    from torch.distributed._composable import checkpoint

    if not units:
        raise ValueError(
            "fsdp_activation_checkpointing=True needs wrapped blocks to checkpoint, but the wrap policy selected none; "
            "use auto_wrap_policy='transformer_based_wrap'."
        )
    for unit in units:
        checkpoint(unit)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit in the model, root included."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(model: nn.Module) -> None:
    """Put every unit back to its sharded parameters (a no_grad forward leaves the root and last block gathered)."""
    for module in fsdp_modules(model):
        module.reshard()


def original_class(module: nn.Module) -> type:
    """The module's own class: `fully_shard` swaps it for a generated `FSDP<Class>` subclass, a name that
    exists nowhere else and must not reach a saved config's `architectures`."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
