"""What `FSDP2Config(compile=True)` changes in the activations a block keeps: which tensors its compiled forward saves
for backward, decided by the same partitioner torch.compile's default backend (inductor) runs.

Used by `activation_trace` only: each block's forward and backward are traced once into one joint graph (AOTAutograd)
and split by the min-cut rematerialization partitioner, which saves the inputs of matmuls and attention and recomputes
cheap elementwise chains (SiLU, the gate product, RMSNorm's fp32 steps) in backward instead of saving their outputs.
The two graphs then run op by op (no code generation), so the trace counts what a compiled block holds between
forward and backward. Fusion's effect inside one kernel (no intermediates at all) is not modelled: the op-by-op run
allocates them briefly, which can only raise the figure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def compile_blocks(model: nn.Module, classes: set[str]) -> None:
    """Run every block of these classes through its partitioned forward/backward graphs, as compiled units do."""
    compiled: dict[tuple, Callable[..., Any]] = {}  # blocks of one class and call signature share one graph
    for module in model.modules():
        if type(module).__name__ in classes:
            module.forward = _compiled_forward(module, compiled)  # an instance attribute: the class is untouched


def _compiled_forward(module: nn.Module, compiled: dict[tuple, Callable[..., Any]]) -> Callable[..., Any]:
    """`module.forward` through the partitioned graphs; the parameters are graph inputs, so their gradients (and the
    tensors those need) stay in the backward graph as they do under torch.compile."""
    forward = type(module).forward
    tracing = [False]  # True while AOTAutograd traces the plain forward through this same attribute

    def call(*args: Any, **kwargs: Any) -> Any:
        if tracing[0]:
            return forward(module, *args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in where]
        key = (
            type(module),
            str(spec),
            repr([leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]),
            tuple((t.shape, t.dtype, t.requires_grad) for t in tensors),
        )
        if key not in compiled:
            compiled[key] = _partitioned(module, leaves, spec, where, tracing)
        return compiled[key]({**dict(module.named_parameters()), **dict(module.named_buffers())}, *tensors)

    return call


def _partitioned(module: nn.Module, leaves: list, spec: Any, where: list[int], tracing: list[bool]) -> Callable:
    """The block as AOTAutograd splits it for inductor, its graphs run as they are (functorch's `nop` compilers)."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition, nop

    def run(state: dict[str, torch.Tensor], *tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, tensor in zip(where, tensors, strict=True):
            filled[i] = tensor
        args, kwargs = tree_unflatten(filled, spec)
        tracing[0] = True
        try:
            return torch.func.functional_call(module, state, args, kwargs)
        finally:
            tracing[0] = False

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    return aot_function(run, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)
