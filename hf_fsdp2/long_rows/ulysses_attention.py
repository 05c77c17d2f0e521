"""Ulysses attention: each rank of a sequence-parallel group holds a contiguous slice of a row; around the attention
call two all-to-alls trade that slice for a slice of the heads over the whole row, and back.

It is an entry of transformers' `AttentionInterface`, so the model's own attention module still projects,
rotates and normalizes its slice; only the attention itself runs on the whole row. Inside, the model's configured
implementation (sdpa, eager, flash attention) runs once per document of the row, so packed documents never see
each other. The documents come from the whole row's position ids (a new document wherever positions do not go up
by one), which every rank of the group holds: they are never rebuilt from a slice.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_NAME = "hf_fsdp2_ulysses"
# Implementations whose call on one document is its causal attention (flash: causal by the module's is_causal).
SUPPORTED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# Keys describing packed documents for flash attention's own varlen path: the documents are passed per call here.
_PACKING_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass
class RowLayout:
    """What the attention of one part needs beyond its slice: the group and the whole rows' documents.

    `group=None` traces memory only (the planner, on fake tensors): each all-to-all allocates what the real one
    would and exchanges nothing.
    """

    group: dist.ProcessGroup | None
    size: int
    implementation: str
    documents: list[list[tuple[int, int]]]  # per row: [start, end) of each document over the whole padded row


_active: RowLayout | None = None


def documents_of(positions: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[start, end) of each document of each row: a new one wherever the position does not go up by one."""
    rows = []
    for row in positions.tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1] + 1]
        rows.append(list(zip(starts, starts[1:] + [len(row)], strict=True)))
    return rows


@contextlib.contextmanager
def ulysses(config: Any, layout: RowLayout) -> Iterator[None]:
    """While inside, `config`'s attention layers run Ulysses attention over `layout`'s group and documents.

    NOTE: the whole training step (forward and backward) runs inside: activation checkpointing recomputes the
    attention in backward, and it must be the same attention.
    """
    global _active
    _register()
    previous, _active = _active, layout
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = layout.implementation
        _active = previous


def _register() -> None:
    """Make the name known to transformers (idempotent): the attention, and a mask function that builds nothing."""
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The model's mask would describe the slice; the attention builds its own from the whole row's documents."""
    return None


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a [batch, heads, slice, dim] query over the whole row, for this rank's share of the heads."""
    layout = _active
    if layout is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside an hf_fsdp2 sequence-parallel step.")
    size, group = layout.size, layout.group
    kv_heads = key.shape[1]
    # GQA with fewer kv heads than ranks (or not a multiple): each kv head is repeated so every rank receives the
    # kv heads its query heads use; with H % N == 0 and H % Hkv == 0, lcm(Hkv, N) divides H.
    repeats = math.lcm(kv_heads, size) // kv_heads
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    query, key, value = (_to_whole_row(t, size, group) for t in (query, key, value))
    local = _GroupedHeads(module, query.shape[1] // key.shape[1])
    kwargs = {k: v for k, v in kwargs.items() if k not in _PACKING_KWARGS}
    output = _per_document(local, query, key, value, layout, kwargs)  # [batch, row, heads / N, dim]
    return _to_slice(output, size, group), None


def _to_whole_row(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, heads, slice, d] on each rank -> [b, heads / N, whole row, d]: rank k receives head block k."""
    b, heads, length, d = x.shape
    send = x.reshape(b, size, heads // size, length, d).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(send, group)  # [source slice, b, h/N, s, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * length, d)


def _to_slice(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, whole row, heads / N, d] -> [b, slice, heads, d] (the layout attention implementations return)."""
    b, row, heads, d = x.shape
    send = x.reshape(b, size, row // size, heads, d).permute(1, 0, 2, 3, 4).contiguous()
    received = _all_to_all(send, group)  # [source head block, b, s, h/N, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, row // size, size * heads, d)


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Block k of dim 0 goes to rank k of the group; backward is the reverse exchange (torch's autograd op)."""
    if group is None:
        return _TracedExchange.apply(send)
    return all_to_all_single(torch.empty_like(send), send, group=group)


class _TracedExchange(torch.autograd.Function):
    """The memory of an all-to-all without a group: a new buffer of the same size, forward and backward."""

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(send)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad)


def _per_document(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: RowLayout,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The configured implementation on each document alone (one call when every row is one document)."""
    attend = _implementation(layout.implementation, module)
    row_length = query.shape[2]
    window = kwargs.get("sliding_window")
    if all(docs == [(0, row_length)] for docs in layout.documents):
        mask = _document_mask(row_length, window, layout.implementation, query)
        return attend(module, query, key, value, mask, **_call_kwargs(layout.implementation, kwargs))[0]
    rows = []
    for index, docs in enumerate(layout.documents):
        pieces = []
        for start, end in docs:
            mask = _document_mask(end - start, window, layout.implementation, query)
            q, k, v = (t[index : index + 1, :, start:end] for t in (query, key, value))
            pieces.append(attend(module, q, k, v, mask, **_call_kwargs(layout.implementation, kwargs))[0])
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _implementation(name: str, module: nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The function the model itself would call: eager attention is each modeling file's own."""
    if name == "eager":
        return sys.modules[type(module._module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _call_kwargs(implementation: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """sdpa is told the document is causal: with no mask it would otherwise read the module's flag."""
    return {**kwargs, "is_causal": True} if implementation == "sdpa" else kwargs


def _document_mask(length: int, window: int | None, implementation: str, like: torch.Tensor) -> torch.Tensor | None:
    """The causal (and sliding-window) mask of one document, in the implementation's format; None where its kernel
    applies causality (and flash attention its window) itself."""
    if implementation.startswith("flash") or (implementation == "sdpa" and (window is None or length <= window)):
        return None
    q = torch.arange(length, device=like.device)[:, None]
    k = torch.arange(length, device=like.device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window  # transformers' sliding_window_overlay
    if implementation == "sdpa":
        return allowed[None, None]
    additive = torch.zeros(length, length, dtype=like.dtype, device=like.device)
    return additive.masked_fill(~allowed, torch.finfo(like.dtype).min)[None, None]


class _GroupedHeads:
    """The attention module as the implementation sees it after the all-to-all: its own attributes, but the query
    heads per kv head of this rank's share (different from the module's when kv heads were repeated)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
