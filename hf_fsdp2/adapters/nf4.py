"""4-bit (NF4) frozen bases for QLoRA: which weights become torchao `NF4Tensor`s, and each rank's NF4 shard
made from its own rows exactly as one process quantizing the whole tensor and chunking it would.

NF4 quantizes each 64-value block with its absmax and double-quantizes those absmax values per 256-value block
around their mean. Everything is local to a block except that mean, so a rank quantizes its rows with the mean
of every rank's block absmax values (one all-gather, then the mean of the whole vector as one process would
take it): bit-equal to `to_nf4(full).chunk(N)[rank]`. FSDP2 then all-gathers the 4-bit inner tensors (torchao
implements its all-gather hooks). Knows nothing about the Trainer or checkpoints.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import alone
from .methods import is_peft_model
from .nf4_nearest import nearest_codes

BLOCK, SCALER_BLOCK = 64, 256  # torchao's defaults (and QLoRA's)
NEAREST_CHUNK = 2**16  # values scaled and coded at once: under 2 MiB of buffers (nf4_nearest)
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"  # where torchao 0.18 defines NF4Tensor


# Bytes an NF4 weight holds per element: 4-bit codes, an int8 scaler per 64 values, a float32 factor per 64 x 256
# values (torchao's double quantization).
NF4_BYTES_PER_ELEMENT = 0.5 + 1 / 64 + 4 / (64 * 256)


def _torchao_nf4() -> Any:
    """torchao's NF4 module, or an error naming the extra to install."""
    # NOTE: torchao may print that its CUDA kernels failed to load; NF4 is pure PyTorch and needs none. We set no
    # environment variable to silence it (process-wide); Troubleshooting says which one a user may set.
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as error:  # NOTE: the module is _NF4_MODULE, which `is_nf4` looks up
        raise ImportError(
            "4-bit (NF4) bases need torchao: pip install 'hf_fsdp2[qlora]' (torchao is an optional extra)."
        ) from error
    return nf4_tensor


def why_not_nf4(param: torch.Tensor, shards: int, role: str | None = None) -> str | None:
    """Why this weight stays dense at `shards` ranks, or None when it can be NF4 and split evenly.

    `role`: the role that keeps its module dense (`dense_roles`), if it has one. Each rank's rows must hold whole
    64 x 256-value scaler blocks, and rows must split evenly (FSDP pads uneven splits, which NF4 cannot do).
    """
    if param.requires_grad:
        return "trainable"
    if param.ndim != 2:
        return f"{param.ndim}-D"
    if role is not None:
        return role
    rows, cols = param.shape
    if rows % shards:
        return f"{rows} rows do not split over {shards} ranks"
    if (rows // shards) * cols % (BLOCK * SCALER_BLOCK):
        return f"a rank's {rows // shards}x{cols} slice is not a whole number of {BLOCK * SCALER_BLOCK}-value blocks"
    return None


def dense_roles(model: nn.Module) -> dict[int, str]:
    """The modules (by id, with everything inside them) whose weights stay dense for their role, as the model
    declares it; whatever their names: its output embeddings (the head, `get_output_embeddings()`), its input
    embeddings, and, for a model that declares no output embeddings, the module holding its last parameter (a task
    head: `score`, `classifier`). Tied weights are found by `nf4_candidates`. These are the modules transformers
    keeps out of bitsandbytes' 4-bit conversion too (`get_keys_to_not_convert`), so both routes quantize the same.

    A PEFT model is asked through its base model; a module peft wrapped (LoRA's layer, modules_to_save) keeps its role
    with everything inside it (the base layer, the original).
    """
    base = model.get_base_model() if is_peft_model(model) else model
    head = _declared(base, "get_output_embeddings")
    found = [
        ("the output embeddings (head)", head),
        ("the input embeddings", _declared(base, "get_input_embeddings")),
        ("the last module (a task head)", _last_module(base) if head is None else None),
    ]
    roles: dict[int, str] = {}
    for role, owner in found:
        for module in owner.modules() if owner is not None else ():
            roles.setdefault(id(module), role)
    return roles


def _declared(model: nn.Module, getter: str) -> nn.Module | None:
    """What `model.get_output_embeddings()` / `get_input_embeddings()` answers, None when it has no such module."""
    get = getattr(model, getter, None)
    try:
        found = get() if callable(get) else None
    except NotImplementedError:  # transformers' base raises it for models without a text embedding
        return None
    return found if isinstance(found, nn.Module) else None


def _last_module(model: nn.Module) -> nn.Module | None:
    """The module holding the model's last parameter (where transformers' task heads sit), or the outermost peft
    layer wrapping it: peft registers an adapter's tensors after the module it wraps."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    last = next(reversed([name for name, _ in model.named_parameters()]), None)
    if last is None:
        return None
    owner = last.rpartition(".")[0]
    parts = owner.split(".") if owner else []
    for depth in range(1, len(parts) + 1):
        module = model.get_submodule(".".join(parts[:depth]))
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            return module
    return model.get_submodule(owner)


def nf4_candidates(model: nn.Module, shards: int) -> tuple[list[str], dict[str, str]]:
    """The frozen linear weights that become NF4 at this shard count, and the other frozen ones with why not.

    Linear layers only (`nn.Linear` and its subclasses: what torchao's NF4 computes with), except those the model
    keeps dense for their role (`dense_roles`) and weights tied to another name.
    """
    roles = dense_roles(model)
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    chosen, dense = [], {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = f"{module_name}.weight"
        tied = [other for other in names_of.get(id(module.weight), []) if other != name]
        reason = why_not_nf4(module.weight, shards, roles.get(id(module)) or (f"tied to {tied[0]}" if tied else None))
        if reason is None:
            chosen.append(name)
        elif reason != "trainable":  # adapters and trained layers are no part of the frozen base
            dense[name] = reason
    return chosen, dense


def describe_dense(dense: dict[str, str]) -> str:
    """The weights kept dense, grouped by why, layer numbers folded into '*' (one short log line per model)."""
    by_reason: dict[str, set[str]] = {}
    for name, reason in dense.items():
        folded = ".".join("*" if part.isdigit() else part for part in name.split("."))
        by_reason.setdefault(reason, set()).add(folded)
    return "; ".join(f"{', '.join(sorted(names))}: {reason}" for reason, names in sorted(by_reason.items()))


def quantize_skeleton(model: nn.Module, names: list[str]) -> None:
    """Make each named (meta) weight a frozen NF4 parameter, before sharding, so FSDP2 gathers it in 4 bits."""
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[leaf] = nn.Parameter(meta_nf4(module._parameters[leaf]), requires_grad=False)


def meta_nf4(weight: torch.Tensor) -> torch.Tensor:
    """The NF4 form of a meta weight, built from its shape alone.

    NOTE: torchao's `to_nf4` on a meta weight runs its whole quantization as meta ops: 8 ms a weight, 0.67 s for
    the 84 weights of the benchmark's 100M Llama on every rank (cProfile), for tensors that hold no values.
    tests/test_qlora.py checks that every inner tensor's shape, stride and dtype equal `to_nf4`'s.
    """
    n_blocks = weight.numel() // BLOCK

    def empty(*shape: int, dtype: torch.dtype = weight.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=weight.device)

    return _nf4_tensor(
        weight,
        scalers=empty(n_blocks, dtype=torch.int8),
        factor=empty(n_blocks // SCALER_BLOCK),
        mean=empty(),
        codes=empty(weight.numel() // 2, dtype=torch.uint8),
        levels=empty(16),
    )


def _nf4_tensor(
    like: torch.Tensor,
    scalers: torch.Tensor,
    factor: torch.Tensor,
    mean: torch.Tensor,
    codes: torch.Tensor,
    levels: torch.Tensor,
) -> torch.Tensor:
    """torchao's NF4Tensor of `like`'s shape, dtype and device from its inner tensors."""
    nf4 = _torchao_nf4()
    meta = nf4.SubclassTensorArgs(like.size(), like.stride(), 0, like.dtype, like.device, False)
    return nf4.NF4Tensor(meta, BLOCK, like.numel() // BLOCK, SCALER_BLOCK, scalers, factor, mean, codes, nf4=levels)


@torch.no_grad()
def nf4_from_rows(rows: torch.Tensor, mean: torch.Tensor, block_absmax: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's NF4 shard of a weight from its own rows and the whole tensor's mean block absmax
    (`block_absmax`: the rows' own, when `global_mean_absmax` already computed it)."""
    nf4 = _torchao_nf4()
    rows = rows.contiguous()
    flat = rows.flatten()
    block_absmax = nf4.get_block_absmax(flat, BLOCK) if block_absmax is None else block_absmax
    scalers = block_absmax - mean
    n_scaler_blocks = scalers.numel() // SCALER_BLOCK
    absmax = nf4.get_block_absmax(scalers, SCALER_BLOCK).unsqueeze(-1).expand(n_scaler_blocks, SCALER_BLOCK)
    factor = 256 / (2 * absmax)  # as torchao computes it, to the bit
    quantized_scalers = (scalers.view(n_scaler_blocks, SCALER_BLOCK) * factor).round().clamp(-128, 127)
    zeros = torch.zeros(BLOCK * SCALER_BLOCK, dtype=rows.dtype, device=rows.device)
    levels = nf4.NF4Tensor.from_tensor(zeros, BLOCK, SCALER_BLOCK).nf4  # torchao's 16 NF4 levels
    return _nf4_tensor(
        rows,
        scalers=quantized_scalers.flatten().to(torch.int8),
        factor=factor[:, 0].clone(memory_format=torch.contiguous_format),  # stride 1 even for one block (FSDP views it)
        mean=mean,
        codes=_nf4_codes(flat, block_absmax, levels),
        levels=levels,
    )


def _nf4_codes(flat: torch.Tensor, absmax: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The packed 4-bit codes of `flat`: torchao's own scaling and, bit-equal, its nearest-level search
    (`nf4_nearest`), chunk by chunk, so the buffers stay far below the weight's size (torchao scales the whole
    weight at once, then builds two 1M x 16 difference matrices per 1M values, 128 MiB in fp32)."""
    nf4 = _torchao_nf4()
    blocks, per_chunk = flat.view(-1, BLOCK), NEAREST_CHUNK // BLOCK
    packed = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=flat.device)
    for first in range(0, blocks.size(0), per_chunk):
        scaled = (blocks[first : first + per_chunk] / absmax[first : first + per_chunk].unsqueeze(-1)).flatten()
        codes = nearest_codes(scaled, levels, nf4.NF4Tensor.quantize_tensor_nearest)
        start = first * BLOCK // 2
        packed[start : start + codes.numel() // 2] = codes[::2] << 4 | codes[1::2]  # two codes per byte, as torchao
    return packed


def global_mean_absmax(rows: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of every block absmax of the whole tensor, as one process computes it over the whole vector, and
    the block absmax values of `rows` (for `nf4_from_rows`).

    `group`: the ranks holding the other rows (None: `rows` is the whole tensor).
    NOTE: collective over `group` (an all-gather of this rank's absmax values); its ranks call it for the same
    weights in the same order. A sum of partial sums is not bit-exact, the mean of the gathered vector is.
    """
    nf4 = _torchao_nf4()
    local = nf4.get_block_absmax(rows.contiguous().flatten(), BLOCK)
    if group is None or alone(group):
        return local.mean(), local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).mean(), local


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for a parameter: its local shard, an NF4 weight counted by its 4-bit inner tensors."""
    local = getattr(tensor, "_local_tensor", tensor)
    if not is_nf4(local):
        return local.numel() * local.element_size()
    inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    return sum(getattr(local, name).numel() * getattr(local, name).element_size() for name in inner)


def is_nf4(tensor: torch.Tensor) -> bool:
    """True for torchao's NF4Tensor (or a DTensor holding one), subclasses included.

    torchao is not imported here (it is an optional extra, and slow to import): a tensor can only be an NF4Tensor
    once torchao's module defining it was imported, so until then nothing is.
    """
    defining = sys.modules.get(_NF4_MODULE)
    return defining is not None and isinstance(getattr(tensor, "_local_tensor", tensor), defining.NF4Tensor)
