"""Activation memory of one forward and backward, traced on fake tensors: no weights, no data, no device.

The model is built from its config on fake tensors (torch's FakeTensorMode) and run once on fake token
ids while a dispatch mode follows every storage the operators allocate and free (the technique of
torch's MemTracker, which cannot follow a model with frozen parameters: it hooks every parameter's
gradient). Gradients are dropped as soon as they are accumulated (under FSDP the unsharded ones are freed
after each unit's reduce-scatter, and the sharded ones are counted apart), so the peak is what
activations and backward temporaries take for this per-device batch, with activation checkpointing
applied per block as sharding applies it."""

from __future__ import annotations

import contextlib
import copy
import functools
import unittest.mock
import weakref
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..loading.skeleton import auto_class_for
from .compiled_blocks import compile_blocks


def traced_activation_bytes(
    config: Any,
    dtype: torch.dtype,
    batch: int,
    seq: int,
    checkpoint_blocks: list[str] | None = None,
    lora: Any = None,
    loss_chunk_size: int | None = None,
    sequence_parallel: int = 1,
    compiled_blocks: list[str] | None = None,
) -> int:
    """Peak bytes of activations and temporaries of one training step of `config`'s causal LM at batch × seq
    (a vision-language model: on text-only rows).

    `checkpoint_blocks`: class names of the blocks whose activations are recomputed in backward (None: none);
    `lora`: a peft LoraConfig to wrap the model with first (frozen base, trainable adapters);
    `loss_chunk_size`: the head and loss over chunks of this many tokens, as FSDP2Trainer runs them;
    `sequence_parallel`: N ranks share each row: one rank's slice of seq / N tokens (padded up), with the
    all-to-all buffers of Ulysses attention over the whole row;
    `compiled_blocks`: class names of the blocks torch.compile compiles (FSDP2Config(compile=True)): they keep what
    its partitioner saves for backward (`compiled_blocks`), not what eager autograd saves (checkpointed ones are
    traced as checkpointed).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    # NOTE: built on meta (peft wraps a meta skeleton fine), then given fake CPU tensors; Module.to and peft's
    # dtype moves fail on fake parameters (they try to swap tensors).
    # NOTE: Trainer trains with `config.use_cache = args.use_cache` (False by default). With the cache on, the
    # trace kept every layer's keys and values, and under activation checkpointing each recomputation appended
    # to them, linking the recomputed graph to the first forward's: +6 GiB at 32k tokens (1B Llama, chunked loss).
    config = copy.deepcopy(config)
    config.use_cache = False
    with torch.device("meta"):
        model = auto_class_for(config).from_config(config, dtype=torch.float32)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(lora))
    with FakeTensorMode():
        # Under FSDP's MixedPrecisionPolicy every parameter, adapters included, computes in this dtype.
        _to_fake(model, dtype)
        if checkpoint_blocks:
            _checkpoint(model, set(checkpoint_blocks))
        # NOTE: a checkpointed block keeps only its input between forward and backward, compiled or not; its
        # recomputation is traced eagerly (fusion can only shrink that transient), so compile changes the rest.
        if set(compiled_blocks or ()) - set(checkpoint_blocks or ()):
            compile_blocks(model, set(compiled_blocks or ()) - set(checkpoint_blocks or ()))
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(_drop_grad)
        # A multimodal config: text-only rows (image activations are not traced: the tower's parameters are).
        vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
        local = -(-seq // sequence_parallel)
        ids = torch.randint(0, vocab, (batch, local))
        positions = torch.arange(local).expand(batch, local)  # any slice: the trace only reads shapes
        tracker = LiveBytes([*model.parameters(), *model.buffers(), ids, positions])
        with (
            tracker,
            _chunked(model, loss_chunk_size),
            _split_rows(model, sequence_parallel, batch, local),
            _one_document_rows(),
        ):
            model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
    return tracker.peak


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that operators allocate inside this mode and that are still alive.

    A storage is counted once (views share it) from the operator that created it until it is freed;
    storages of `existing` tensors (parameters, buffers, inputs) are never counted.
    """

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._known: set[StorageWeakRef] = {StorageWeakRef(t.untyped_storage()) for t in existing}
        self._watch: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = _grouped_mm(func, args, kwargs) if func is _GROUPED_MM else func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = StorageWeakRef(storage)
        if key in self._known:
            return
        self._known.add(key)
        nbytes = storage.nbytes()
        self.live += nbytes
        self._watch.append(weakref.ref(storage, functools.partial(self._free, key, nbytes)))

    def _free(self, key: StorageWeakRef, nbytes: int, _ref: weakref.ref) -> None:
        self.live -= nbytes
        self._known.discard(key)


_GROUPED_MM = torch.ops.aten._grouped_mm.default


def _grouped_mm(func: Any, args: Any, kwargs: Any) -> torch.Tensor:
    """MoE experts' grouped matmul (Qwen3-MoE, Mixtral, gpt-oss on transformers 5): the CPU kernel takes float32
    (real runs train), but torch's fake kernel accepts only bfloat16. Its output's shape does not depend on the
    dtype, so the fake kernel runs on bfloat16 copies (not counted: made below this mode) and the result is given
    back in the input's dtype, counted like any output."""
    dtype = args[0].dtype
    if dtype == torch.bfloat16:
        return func(*args, **(kwargs or {}))
    cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kwargs = {k: v for k, v in (kwargs or {}).items() if k != "out_dtype"}
    return func(*cast, **kwargs).to(dtype)


def _chunked(model: nn.Module, chunk_size: int | None) -> contextlib.AbstractContextManager:
    """The trainer's chunked loss around the traced step, when it would chunk this model's loss."""
    from ..long_rows.chunked_loss import chunked_loss, why_not_chunked

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if chunk_size is None or why_not_chunked(base) is not None:
        return contextlib.nullcontext()
    return chunked_loss(base, chunk_size)


def _split_rows(model: nn.Module, size: int, batch: int, local: int) -> contextlib.AbstractContextManager:
    """Ulysses attention over rows of `size` x `local` tokens (one document each), exchanging nothing."""
    if size == 1:
        return contextlib.nullcontext()
    from ..long_rows.ulysses_attention import RowLayout, ulysses

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    implementation = base.config._attn_implementation or "eager"
    documents = [[(0, size * local)] for _ in range(batch)]
    return ulysses(base.config, RowLayout(None, size, implementation, documents))


def _one_document_rows() -> contextlib.AbstractContextManager:
    """Rows of one document each, as transformers finds them in a real run by reading the position ids.

    NOTE: without a KV cache transformers looks for packed documents in the position ids; it cannot read fake ones,
    so it would build a full causal mask and, for grouped-query attention, repeat keys and values to every head
    (measured on the trace: +1.3 GiB for a 1B Llama at 4 x 2048 tokens). Real rows of one document take SDPA's
    mask-free causal path with grouped heads, which is what the GPU runs measured."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return unittest.mock.patch.object(masking_utils, "find_packed_sequence_indices", return_value=None)


def _to_fake(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every parameter and buffer with a fake CPU tensor (floating ones in `dtype`), keeping ties."""
    done: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in done:
            kind = dtype if tensor.is_floating_point() else tensor.dtype
            new = torch.zeros(tensor.shape, dtype=kind, device="cpu")
            done[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        return done[id(tensor)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = fake(param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = fake(buffer)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _checkpoint(model: nn.Module, classes: set[str]) -> None:
    """Recompute each block's activations in backward, as `sharding` does for its units."""
    from torch.distributed._composable import checkpoint

    for module in model.modules():
        if type(module).__name__ in classes:
            checkpoint(module)
