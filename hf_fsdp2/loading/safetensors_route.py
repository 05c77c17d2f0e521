"""The safetensors route: every rank matches the model's tensors to the checkpoint's keys, then reads only its own
slices of each, straight into its shards (torch DCP with `SliceReader`); NF4 weights from their rows, quantized
one weight at a time.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ..adapters.nf4 import global_mean_absmax, is_nf4, nf4_from_rows
from ..distributed import get_device, raise_if_any_rank
from .facts import facts_of
from .safetensors_reader import SliceReader
from .skeleton import get_tensor


@dataclass
class SafetensorsPlan:
    """Which checkpoint key fills each model tensor, and which tensors the checkpoint lacks."""

    keys: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)  # PEFT's own tensors: in no base checkpoint


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
        tensor = get_tensor(model, names[0])
        spellings = [facts.base_name(n) for n in names]
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


def read_safetensors_shards(model: nn.Module, path: str, plan: SafetensorsPlan, device: torch.device) -> None:
    """Read each rank's slices of every planned tensor straight from the safetensors files (NF4 weights: their
    rows, then quantized, one weight at a time, so no rank holds more than one dense slice of them)."""
    nf4 = [name for name in plan.keys if is_nf4(get_tensor(model, name))]
    state = {key: get_tensor(model, name) for name, key in plan.keys.items() if name not in nf4}
    # NOTE: each rank plans its own reads (no_dist): its shards say which slices it needs, and the checkpoint's
    # keys and shapes were already agreed in weights.choose_route. DCP's global planning (two object gathers over the
    # ranks) added nothing but waiting; one agreement afterwards still fails every rank if any rank failed.
    problem, reader = None, SliceReader(path)
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # NOTE: raised on every rank just below, so no rank waits
        # for a failed one. DCP reports a failed read as a CheckpointException, a BaseException.
        problem = f"reading {path}: {type(error).__name__}: {error}"
    raise_if_any_rank(problem)
    for name in nf4:
        quantized, problem = _read_nf4(get_tensor(model, name), plan.keys[name], reader, device, problem)
        module_name, _, leaf = name.rpartition(".")
        # NOTE: assign, so FSDP2's post-load hook re-points its parameter at the new shard.
        model.get_submodule(module_name).load_state_dict({leaf: quantized}, strict=False, assign=True)
        if device.type == "cpu":
            release_free_heap()
    raise_if_any_rank(problem)


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
