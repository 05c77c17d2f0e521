"""Getting weights into a sharded model without any rank holding more than it must.

Two routes, chosen per model:
- safetensors on every rank: each rank reads only its own slices (torch DCP, with a reader that reads
  rows in place: see safetensors_reader);
  what the checkpoint lacks (a new head, RoPE buffers, PEFT adapters) is initialized as `from_pretrained`
  (and peft) would have, from the RNG state the skeleton was built with.
- otherwise (a model object, `.bin` files, files only rank 0 can see, keys that need transformers'
  conversion): rank 0's weights are the truth and are broadcast tensor by tensor.
It knows how to shard only through the callable it is given.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from ..adapters.methods import base_name, replay_adapters, replayed_adapter_values
from ..adapters.nf4 import global_mean_absmax, is_nf4, nf4_from_rows
from ..adapters.trainable_tokens import checkpoint_row_reader, initial_token_values
from ..distributed import (
    broadcast_from_rank0,
    first_on_any_rank,
    get_device,
    is_rank0,
    log_rank0,
    raise_if_any_rank,
    warn_rank0,
)
from .facts import facts_of, unwrap_peft
from .safetensors_reader import SliceReader
from .skeleton import PretrainedSource, build_skeleton, first_meta_tensor, loaded_values, move_to_meta, set_tensor

ShardFn = Callable[[nn.Module], None]
_INIT_FLAG = "_is_hf_initialized"


@dataclass
class SafetensorsPlan:
    """Which checkpoint key fills each model tensor, and which tensors the checkpoint lacks."""

    keys: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)  # PEFT's own tensors: in no base checkpoint


def _tensor_names(model: nn.Module) -> list[list[str]]:
    """Parameters and persistent buffers as lists of names (one list per tie group)."""
    grouped = facts_of(model).tie_map
    names = [grouped.get(name, [name]) for name, _ in model.named_parameters()]
    for module_name, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None and leaf not in module._non_persistent_buffers_set:
                names.append([f"{module_name}.{leaf}" if module_name else leaf])
    return names


def _candidates(name: str, prefix: str) -> list[str]:
    """Checkpoint spellings of a model key: as is, without and with the base-model prefix."""
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1 :])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


def plan_safetensors_load(model: nn.Module, checkpoint_shapes: dict[str, torch.Size]) -> SafetensorsPlan:
    """Match model tensors to checkpoint keys; raise ValueError naming the first shape mismatch.

    Raises:
        ValueError: when a checkpoint tensor's shape differs from the model's (another model or config).
    """
    plan = SafetensorsPlan()
    prefix = getattr(model, "base_model_prefix", "")
    facts = facts_of(model)
    for names in _tensor_names(model):
        if facts.is_adapter(names[0]):
            plan.adapters.append(names[0])
            continue
        tensor = _get(model, names[0])
        spellings = [base_name(n, facts.base_root) for n in names] if facts.is_peft else names
        found = next((key for n in spellings for key in _candidates(n, prefix) if key in checkpoint_shapes), None)
        if found is None:
            plan.missing.append(names[0])
            continue
        if tuple(checkpoint_shapes[found]) != tuple(tensor.shape):
            raise ValueError(
                f"{names[0]}: the checkpoint's {found} has shape {tuple(checkpoint_shapes[found])}, the model "
                f"expects {tuple(tensor.shape)}. The checkpoint belongs to another model or config."
            )
        plan.keys[names[0]] = found
    plan.unused = sorted(set(checkpoint_shapes) - set(plan.keys.values()))
    return plan


def is_pretrained_model(model: nn.Module) -> bool:
    """isinstance(model, PreTrainedModel), importing transformers' modeling code only when asked: the offline
    consolidation command imports this module and must start without it (see hf_fsdp2/__init__.py)."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _is_param(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(module_name)._parameters


def _non_persistent_buffers(model: nn.Module) -> list[str]:
    """Names of buffers that no checkpoint holds (RoPE inv_freq and friends)."""
    return [
        f"{module_name}.{leaf}" if module_name else leaf
        for module_name, module in model.named_modules()
        for leaf in module._non_persistent_buffers_set
        if module._buffers.get(leaf) is not None
    ]


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
    values = {name: _get(model, name).detach() for name in todo}
    for name in todo:
        _set_storage(model, groups.get(name, [name]), "meta")
    _clear_init_flags(model)
    return values


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
    source, root = facts.source, facts.base_root
    kept = values_loaded_into_skeleton(model)
    # Adapter buffers outside the state dict too (VeRA's projections with save_projection=False): no checkpoint
    # holds them either, and peft computes them.
    adapters = [*plan.adapters, *(n for n in _non_persistent_buffers(model) if facts.is_adapter(n))]
    replay = [n for n in adapters if _get(model, n).is_meta and n not in kept]
    given = {n: kept.get(n, _get(model, n)).detach().cpu() for n in adapters if n not in replay}
    with rng_state(state):
        # A PEFT model's base is initialized as the unwrapped model it was built from, then its adapters.
        pristine = build_skeleton(source.path, source.auto_class, source.kwargs)
        base_values = init_missing(pristine, sorted({base_name(n, root) for n in plan.missing}))
        values = replayed_adapter_values(model, pristine, replay) if replay else {}
    for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        if base_name(name, root) in base_values and not facts.is_adapter(name):
            values[name] = base_values[base_name(name, root)]
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


def _get(model: nn.Module, name: str) -> torch.Tensor:
    return model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)


def _set_storage(model: nn.Module, names: list[str], device: str) -> None:
    """Give a (possibly tied) parameter or buffer fresh storage on `device`, keeping its dtype and tie."""
    old = _get(model, names[0])
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


def materialize(model: nn.Module, offload: bool, skip_nf4: bool = False) -> torch.device:
    """Allocate each rank's shards (values undefined); with CPU offload, shards live in host memory.

    `skip_nf4`: NF4 weights stay on the meta device, for `read_safetensors_shards` makes them from each rank's
    rows; allocating them here too would hold every NF4 shard twice at the load peak.
    """
    device = get_device()
    target = torch.device("cpu") if offload else device
    model._apply(lambda t: t if skip_nf4 and is_nf4(t) else torch.empty_like(t, device=target))
    if offload and device.type != "cpu":
        for module in model.modules():
            for leaf, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[leaf] = buffer.to(device)
    return target


@torch.no_grad()
def copy_full_into_shards(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (identical on every rank) into this rank's shards, without communication."""
    for name, full in values.items():
        copy_full_into(_get(model, name), full)


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy one full tensor into `target`, of which this rank may hold only a shard (a DTensor)."""
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(full)


def shape_mismatch(
    stored: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]
) -> tuple[str, tuple, tuple] | None:
    """The first tensor of `live` that `stored` holds with another shape: (name, stored shape, live shape)."""
    for name, tensor in live.items():
        if tuple(stored[name].shape) != tuple(tensor.shape):
            return name, tuple(stored[name].shape), tuple(tensor.shape)
    return None


def read_safetensors_shards(model: nn.Module, path: str, plan: SafetensorsPlan, device: torch.device) -> None:
    """Read each rank's slices of every planned tensor straight from the safetensors files (NF4 weights: their
    rows, then quantized, one weight at a time, so no rank holds more than one dense slice of them)."""
    nf4 = [name for name in plan.keys if is_nf4(_get(model, name))]
    state = {key: _get(model, name) for name, key in plan.keys.items() if name not in nf4}
    # NOTE: each rank plans its own reads (no_dist): its shards say which slices it needs, and the checkpoint's
    # keys and shapes were already agreed in choose_route. DCP's global planning (two object gathers over the
    # ranks) added nothing but waiting; one agreement afterwards still fails every rank if any rank failed.
    problem, reader = None, SliceReader(path)
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # NOTE: raised on every rank just below, so no rank waits
        # for a failed one. DCP reports a failed read as a CheckpointException, a BaseException.
        problem = f"reading {path}: {type(error).__name__}: {error}"
    raise_if_any_rank(problem)
    for name in nf4:
        quantized, problem = _read_nf4(_get(model, name), plan.keys[name], reader, device, problem)
        module_name, _, leaf = name.rpartition(".")
        # NOTE: assign, so FSDP2's post-load hook re-points its parameter at the new shard.
        model.get_submodule(module_name).load_state_dict({leaf: quantized}, strict=False, assign=True)
        if device.type == "cpu":
            release_free_heap()
    raise_if_any_rank(problem)


def release_free_heap() -> None:
    """Give the pages of freed host memory back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Each NF4 weight's dense rows and quantization buffers (several MiB) are freed between small long-lived NF4
    shards; glibc keeps the freed pages, so one rank's resident memory grew with every weight (measured on the
    benchmark's 100M Llama at 2 ranks: +129 MiB on one rank for 44 MiB of NF4 shards).
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (its malloc_trim), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _read_nf4(
    target: torch.Tensor, key: str, reader: SliceReader, device: torch.device, problem: str | None
) -> tuple[torch.Tensor, str | None]:
    """This rank's rows of one weight (`target`, still on meta), quantized to NF4 on `device` as one process
    would quantize the whole tensor; and the first read problem of this rank so far.

    NOTE: each rank reads its rows alone (no_dist): DCP's global planning ran two object collectives per weight,
    1.4 of the 100M Llama's 6.4 s QLoRA load (cProfile, rank 0). A rank whose read failed (`problem`) goes on
    quantizing unread rows, so every rank still joins each weight's absmax all-gather; the caller raises after
    the last weight.
    """
    if not isinstance(target, DTensor):  # one shard: NF4 weights stay outside FSDP (see sharding)
        rows = torch.empty(target.shape, dtype=target.dtype, device=get_device())
        problem = _read_rows(rows, key, reader, problem)
        return nn.Parameter(nf4_from_rows(rows, *global_mean_absmax(rows)), requires_grad=False), problem
    mesh, layout = target.device_mesh, dict(placements=target.placements, shape=target.shape, stride=target.stride())
    rows = torch.empty(target.to_local().shape, dtype=target.dtype, device=device)
    problem = _read_rows(DTensor.from_local(rows, mesh, **layout), key, reader, problem)
    local = nf4_from_rows(rows, *global_mean_absmax(rows, mesh.get_group(mesh.ndim - 1)))
    return DTensor.from_local(local, mesh, **layout), problem


def _read_rows(rows: torch.Tensor, key: str, reader: SliceReader, problem: str | None) -> str | None:
    """Fill `rows` with this rank's part of `key` unless an earlier read failed; the first problem, if any."""
    if problem is not None:
        return problem
    try:
        dcp.load({key: rows}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # raised on every rank by the caller, after the last weight
        return f"reading {key} from {reader.path}: {type(error).__name__}: {error}"
    return None


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Send every buffer from rank 0 (non-persistent ones are in no state dict)."""
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)


def safetensors_shapes(path: str) -> dict[str, torch.Size] | None:
    """Shapes of every tensor in a folder's safetensors files, or None if it has none.

    Raises:
        ValueError: when a file's header cannot be read (a truncated or corrupted download), naming the folder.
    """
    if not os.path.isdir(path) or not glob.glob(os.path.join(path, "*.safetensors")):
        return None
    try:
        metadata = HuggingFaceStorageReader(path).read_metadata()
    except Exception as error:  # safetensors' own error type; every rank reads the same headers and fails alike
        raise ValueError(
            f"reading {path}: its safetensors files cannot be read ({type(error).__name__}: {error}); a truncated "
            "or corrupted download? Download or save the model again."
        ) from error
    return {key: md.size for key, md in metadata.state_dict_metadata.items()}


def needs_conversion(model: nn.Module) -> str | None:
    """Name the reason the checkpoint's keys need transformers' own conversion, or None."""
    model = unwrap_peft(model)
    if not is_pretrained_model(model):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    return f"{type(model).__name__} needs weight conversions ({len(conversions)})" if conversions else None


def choose_route(model: nn.Module) -> SafetensorsPlan | None:
    """Return the plan for reading slices on every rank, or None to broadcast rank 0's weights.

    NOTE: every rank joins the same collective here, even when its own answer is already known, because
    ranks may disagree (a real object on rank 0, a skeleton elsewhere) and must still agree on the route.
    """
    source = facts_of(model).source
    shapes = safetensors_shapes(source.path) if source is not None else None
    if source is None:
        reason = "the model is an object, so rank 0's weights are the truth"
    else:
        reason = needs_conversion(model) or (None if shapes else f"no *.safetensors readable in {source.path}")
    _, reason = first_on_any_rank(reason)
    if reason:
        log_rank0("Loading on rank 0 and broadcasting: %s.", reason)
        return None
    plan = plan_safetensors_load(model, shapes)
    if plan.missing:
        warn_rank0("Not in the checkpoint, newly initialized: %s", plan.missing)
    if plan.unused:
        log_rank0("Checkpoint tensors the model does not use: %s", plan.unused)
    return plan


def load_pretrained(model: nn.Module, shard: ShardFn, offload: bool = False) -> nn.Module:
    """Shard `model` with `shard` and fill every rank's shards with the right weights; verify the result."""
    facts = facts_of(model)
    plan = choose_route(model)
    state = skeleton_rng_state(model)
    if plan is not None:
        facts.missing = list(plan.missing)
        initial = initial_values(model, plan, state)
        shard(model)
        device = materialize(model, offload, skip_nf4=True)
        # NOTE: what the checkpoint lacks goes into its shards before the checkpoint is read, so its full values
        # (every LoRA matrix, whole, on every rank) are freed before the read's peak instead of held through it.
        copy_full_into_shards(model, initial)
        del initial
        if device.type == "cpu":
            release_free_heap()
        read_safetensors_shards(model, facts.source.path, plan, device)
    else:
        weights, buffers = _rank0_state(model, state)
        move_to_meta(model, facts.tie_groups)
        shard(model)
        materialize(model, offload)
        load_parameters_from_rank0(model, weights)
        copy_full_into_shards(model, buffers)
        del weights, buffers
        broadcast_buffers(model)
    facts.verify(model)
    loaded_values(unwrap_peft(model)).clear()  # now in the shards
    return model


def load_parameters_from_rank0(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Fill every rank's parameter shards from rank 0's full `weights` (buffers are sent on their own).

    Raises:
        RuntimeError: naming a parameter that rank 0's state did not fill.
    """
    # NOTE: buffers and the further names of tied parameters are left out, and the load is not strict: torch's
    # state dict names a tensor under several names once (VeRA's projections, one BufferDict referenced by every
    # adapted layer; prompt learning's `word_embeddings`, the base's embedding module under a second name), and a
    # strict load wanted the other names too (rank 1: "Missing key(s)"; rank 0 copied a full tensor into a shard).
    # Buffers go out by broadcast_buffers; the ties share the first name's parameter; the rest is checked here.
    aliases = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    aliases |= {name for names in facts_of(model).tie_groups for name in names[1:]}
    weights = {name: tensor for name, tensor in weights.items() if name not in aliases}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    result = set_model_state_dict(model, weights, options=options)
    unloaded = [name for name in result.missing_keys if name not in aliases]
    if unloaded or result.unexpected_keys:
        raise RuntimeError(
            f"rank 0's weights do not fit the model: missing {unloaded[:3]}, unexpected {result.unexpected_keys[:3]}."
        )


Rank0State = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def _rank0_state(model: nn.Module, rng: torch.Tensor) -> Rank0State:
    """On rank 0, the full state dict and all buffers that every rank will be given; empty elsewhere."""
    problem: str | None = None
    state: Rank0State = ({}, {})
    if is_rank0():
        try:
            with rng_state(rng):
                state, problem = _full_state_on_rank0(model)
        except Exception as error:  # NOTE: re-raised on every rank below, so no rank waits forever.
            problem = f"{type(error).__name__}: {error}"
    raise_if_any_rank(problem)
    return state


def _full_state_on_rank0(model: nn.Module) -> tuple[Rank0State, str | None]:
    """Read the whole model on rank 0, from its source path or from the object itself."""
    facts = facts_of(model)
    source: PretrainedSource | None = facts.source
    if source is not None:
        real = source.auto_class.from_pretrained(source.path, **source.kwargs)
        if facts.is_peft:
            # The adapters as peft made them on this base; ones the skeleton already holds take precedence.
            given = {n: t for n, t in model.state_dict().items() if not t.is_meta}
            given.update(values_loaded_into_skeleton(model))
            real = replay_adapters(real, model)
            real.load_state_dict(given, strict=False)
        model = real
    else:
        meta = first_meta_tensor(model)
        if meta is not None:
            return ({}, {}), (
                f"rank 0's model has {meta} on the meta device; rank 0 must hold real weights, or build the "
                "model with hf_fsdp2.from_pretrained(path) so each rank reads its own part."
            )
    return (model.state_dict(), dict(model.named_buffers())), None
