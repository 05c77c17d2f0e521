"""Sharded modules called under `torch.inference_mode()`: TRL scores reward models that way, and users' evaluation
callbacks do too.

It owns one switch, put on every FSDP unit when it is sharded; it knows nothing of trainers or of what the module is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

_STACK = "_hf_fsdp2_inference_switches"


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Turn inference mode off (keeping gradients off) for the block, if it is on; otherwise change nothing.

    NOTE: FSDP2 (torch 2.13) allocates each unit's all-gather output and unsharded parameters lazily, at its first
    unshard, and reuses them for the module's life. Allocated under inference mode they are inference tensors: at
    world size 1 the very first forward fails (`wait_for_unshard` reads their version counter: "Inference tensors do
    not track version counter"); at N ranks inference forwards work, but every later forward or backward outside
    inference mode fails ("Inplace update to inference tensor outside InferenceMode"). Measured with plain
    `fully_shard` on gloo at 1 and 2 ranks (tests/test_inference_mode.py). Under `no_grad` with inference mode off,
    FSDP2 takes its ordinary no-grad path, with the same numbers; the outputs are ordinary tensors that need no grad.
    """
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def allow_inference_mode(model: nn.Module) -> None:
    """Let every FSDP unit of `model` run its forward under `torch.inference_mode()`, as an ordinary no-grad forward.

    The switch is a forward pre-hook run before FSDP2's own (which unshards) and undone by a forward hook run after
    FSDP2's (which reshards), also when the forward raises. Inputs made under inference mode are cloned, since the
    model may update them in place and inference tensors refuse that outside inference mode.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule) and not hasattr(module, _STACK):
            setattr(module, _STACK, [])
            module.register_forward_pre_hook(_enter, prepend=True, with_kwargs=True)
            module.register_forward_hook(_leave, always_call=True)


# NOTE: both hooks run inside a compiled unit's `_call_impl` (FSDP2Config(compile=True) compiles each block with its
# hooks). Traced, `torch.is_inference_mode_enabled()` is a graph break in every block (dynamo cannot trace it); left
# out of tracing they run eagerly, as FSDP2's own hooks around them are (torch's `_dynamo_disable`): no graph breaks
# (tests/test_inference_mode.py compiled scenario), and a compiled unit still leaves inference mode.
_NOT_TRACED = {"recursive": True, "reason": "hf_fsdp2's inference-mode switch runs eagerly, as FSDP2's hooks do"}


@torch.compiler.disable(**_NOT_TRACED)
def _enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Leave inference mode for this forward (a no-op when it is off or an outer unit already left it)."""
    stack = contextlib.ExitStack()
    getattr(module, _STACK).append(stack)
    if not torch.is_inference_mode_enabled():
        return args, kwargs
    stack.enter_context(outside_inference_mode())
    return tuple(_ordinary(a) for a in args), {k: _ordinary(v) for k, v in kwargs.items()}


@torch.compiler.disable(**_NOT_TRACED)
def _leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Restore the mode the caller had, after FSDP2's post-forward ran."""
    stack = getattr(module, _STACK)
    if stack:
        stack.pop().close()


def _ordinary(value: Any) -> Any:
    """An inference tensor cloned into an ordinary one (same values); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_inference():
        return value.clone()
    return value
