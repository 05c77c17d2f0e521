"""The sharded model's own `save_pretrained` and `generate`, which every rank must call.

A sharded model holds only this rank's slices, so `PreTrainedModel.save_pretrained` (and `push_to_hub`, which
calls it) would write shards as if they were whole tensors, and `generate` runs forwards that all-gather
from every rank (once per call here: `gathered`, unless the gathered model would not fit). Here `save_pretrained`
becomes the streamed export `trainer.save_model` writes, and both
first check that every rank joined: a call on one rank only (`if is_world_process_zero(): ...`) fails within
`JOIN_TIMEOUT_S` naming the fix, instead of hanging in a collective the other ranks never enter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from ..distributed import agree, alone, is_host_group, new_host_group, warn_rank0
from .gathering import free_memory, gathered, gathered_bytes
from .units import COMPILED_BY_US

# The methods `attach_collective_methods` sets on the sharded model (instance attributes).
COLLECTIVE_METHODS = ("save_pretrained", "generate")
# How long a rank waits for the others at a collective method before it names the problem.
JOIN_TIMEOUT_S = 60
# The share of free memory the gathered model may take; the rest is for the KV cache and activations.
GENERATION_HEADROOM = 0.7
_cpu_groups: dict[str, Any] = {}


def cpu_group() -> Any:
    """A gloo group over all ranks (monitored barriers need gloo): the default group if it is gloo.

    NOTE: collective the first time on a non-gloo default group (creates the group): call it on every rank.
    """
    if is_host_group(None):
        return dist.group.WORLD
    if "gloo" not in _cpu_groups:
        _cpu_groups["gloo"] = new_host_group()
    return _cpu_groups["gloo"]


def all_ranks_join(what: str) -> None:
    """Return when every rank has reached `what`; raise naming the fix when one has not within the bound.

    Raises:
        RuntimeError: when some rank did not call `what` within JOIN_TIMEOUT_S seconds.
    """
    if alone():
        return
    try:
        dist.monitored_barrier(group=cpu_group(), timeout=timedelta(seconds=JOIN_TIMEOUT_S), wait_all_ranks=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"{what} on a model sharded by hf_fsdp2 is collective: every rank must call it, but rank "
            f"{dist.get_rank()} waited {JOIN_TIMEOUT_S} s for the others ({error}); the process group cannot be "
            "trusted after this, so end the job. Call it on every rank; for a Hugging Face folder use "
            "trainer.save_model(dir), which every rank runs and rank 0 writes."
        ) from error


def attach_collective_methods(model: nn.Module, export: Callable[..., None], gather_for_generate: bool = True) -> None:
    """Give the sharded `model` a save_pretrained that writes the streamed export `export` (passed in: the export
    imports this module's COLLECTIVE_METHODS), and a guarded generate that gathers every unit once per call
    (`gather_for_generate`, when the gathered model fits).

    NOTE: collective (it may create the gloo group the checks use).
    """
    if not alone():
        cpu_group()
    # Through __dict__: an instance attribute wins over the class's method (also over fully_shard's FSDP<Class>
    # and peft's wrappers), and push_to_hub calls self.save_pretrained.
    model.__dict__["save_pretrained"] = functools.partial(_save_pretrained, export, model)
    generate = getattr(model, "generate", None)
    if callable(generate):
        call = functools.partial(_generate, generate, model, gather_for_generate)
        model.__dict__["generate"] = functools.wraps(generate)(call)


def _save_pretrained(
    export: Callable[..., None],
    model: nn.Module,
    save_directory: str,
    *args: Any,
    max_shard_size: str | int = "5GB",
    **kwargs: Any,
) -> None:
    """`save_pretrained(dir)` of the sharded model: the folder `trainer.save_model(dir)` writes."""
    all_ranks_join("save_pretrained")
    export(model, str(save_directory), max_shard_size=max_shard_size)


def _generate(generate: Any, model: nn.Module, gather: bool, *args: Any, **kwargs: Any) -> Any:
    """The model's own generate, once every rank has called it, with compiled blocks run eagerly; with `gather`,
    inside `gathered(model)` and unsynced when the gathered model fits on every rank (else per-token gathering,
    said once)."""
    all_ranks_join("generate")
    with eager_blocks(model):
        if not gather or not gathered_fits(model):
            return generate(*args, **kwargs)
        # NOTE: synced_gpus (set by transformers for a sharded model, and by Seq2SeqTrainer) keeps every rank running
        # forwards until all have finished, with an all-reduce per token, so per-token all-gathers stay matched. The
        # gathered forwards run no collective, so each rank stops when its own rows are done and skips the
        # all-reduces.
        kwargs["synced_gpus"] = False
        with gathered(model):
            return generate(*args, **kwargs)


@contextlib.contextmanager
def eager_blocks(model: nn.Module) -> Iterator[None]:
    """Run the blocks FSDP2Config(compile=True) compiled eagerly inside the block, then compiled again.

    Decoding changes shapes every token, and a KV cache makes each block's layer index a guard: a compiled block
    recompiles per layer until dynamo's limit (8 entries, shared by every block), then runs eagerly anyway. On the
    tiny Llama: 6 frames compiled for one 5-token generate (tests/test_parity.py's GENERATE_WITH run).
    NOTE: `_compiled_call_impl` is where `nn.Module.compile()` keeps the compiled call (torch 2.2 on). Cleared on the
    blocks `shard_model` compiled only: a compile the user set up (their own, transformers' static-cache one) runs.
    """
    compiled = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, COMPILED_BY_US, False)]
    for module, _ in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call


def gathered_fits(model: nn.Module) -> bool:
    """True when every rank has room for the whole model in its compute dtype (the same answer on every rank)."""
    need = gathered_bytes(model)
    fits = agree([1 if need <= GENERATION_HEADROOM * free_memory() else 0], "min", None if alone() else cpu_group())[0]
    if not fits and not getattr(model, "_hf_fsdp2_said_per_token", False):
        model._hf_fsdp2_said_per_token = True
        warn_rank0(
            "generate: the gathered model (%.1f GiB in its compute dtype) would not fit beside what this rank holds; "
            "gathering each unit per token instead (slower). FSDP2Config(gather_for_generate=False) says so upfront.",
            need / 2**30,
        )
    return bool(fits)
