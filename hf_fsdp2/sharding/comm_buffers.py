"""Reuse FSDP2's flat communication buffers from step to step on the CPU.

On a GPU the caching allocator hands each step's all-gather and reduce-scatter buffers back to the next
step. On the CPU every buffer over glibc's mmap threshold (32 MiB at most) is a fresh mapping whose pages
the kernel zero-fills on first touch, every step. These comms keep the flat buffers instead and hand one out
again once nothing else holds it. The pool ends up with as many buffers of a unit's size as were in flight at
once (two or three blocks' worth); they stay allocated between steps. The per-parameter copies FSDP2 makes
from the flat buffer, and autograd's gradients, are still allocated afresh.

Measured (1.2B Llama, 2 CPU ranks, SGD, one step profiled after four): page faults 36-42 -> 24-28 GiB per rank
per step, `aten::copy_` 15.9 -> 9.8 s and `aten::cat` 2.5 -> 0.5 s of CPU time, peak RSS +0.5 GB per rank.

NOTE: FSDP2's comm classes and the storage use count are private torch APIs (torch pinned below 2.16).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter


class BufferPool:
    """Flat buffers by (numel, dtype); one is handed out again only when the pool holds its only reference."""

    def __init__(self) -> None:
        self._free_count = _free_use_count()
        self._buffers: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer nobody else holds, or a new one kept for the next request of this shape."""
        buffers = self._buffers.setdefault((numel, dtype, device), [])
        for buffer in buffers:
            if _use_count(buffer) == self._free_count:
                return buffer
        buffer = torch.empty(numel, dtype=dtype, device=device)
        buffers.append(buffer)
        return buffer

    def holds(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this shape was asked for by an all-gather (the reduce-scatter input has the same shape)."""
        return (numel, dtype, device) in self._buffers

    def count(self) -> int:
        """How many buffers the pool keeps allocated."""
        return sum(len(buffers) for buffers in self._buffers.values())


def _use_count(tensor: torch.Tensor) -> int:
    """References to the tensor's storage: views, FSDP2's results and in-flight work all hold one."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _free_use_count() -> int:
    """The storage use count of a tensor only the pool holds (the count includes the call's own handle)."""
    return _use_count(torch.empty(1))


def _numel(size: Sequence[int | torch.SymInt]) -> int:
    """Elements of a buffer FSDP2 asks for by size."""
    numel = 1
    for dim in size:
        numel *= int(dim)
    return numel


class PooledAllGather(DefaultAllGather):
    """FSDP2's all-gather, into a reused flat buffer."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.pool.get(_numel(size), dtype, device).view(*size)


class PooledReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter, from a reused flat input; the output (the sharded gradient) is not pooled."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = _numel(size)
        # The sharded gradient output lives until zero_grad: pooling it would keep every gradient allocated
        # through the next forward. Only the input, the shape of an all-gather, is handed back.
        if self.pool.holds(numel, dtype, device):
            return self.pool.get(numel, dtype, device).view(*size)
        return torch.empty(*size, dtype=dtype, device=device)


def pool_comm_buffers(model: torch.nn.Module) -> BufferPool:
    """Give every FSDP module of the model comms that share one buffer pool (for CPU meshes; see the module)."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    pool = BufferPool()
    all_gather, reduce_scatter = PooledAllGather(pool), PooledReduceScatter(pool)
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return pool
