"""What would fit instead: the single changes to a run that does not fit (more ranks, activation checkpointing,
CPU offload, LoRA, sequence parallelism) that do, each with its training peak."""

from __future__ import annotations

import functools
from dataclasses import asdict, replace
from typing import Any

from .model_sizes import model_sizes
from .phases import cached_activations, phases_for
from .plan_types import PlanRequest


def alternatives(request: PlanRequest, available: int) -> list[dict[str, Any]]:
    """Single changes that fit, with their training peaks: the fewest more ranks, activation checkpointing,
    CPU offload (only where there is an accelerator to offload from), LoRA (r=16 on the attention projections),
    sequence parallelism over pairs of ranks."""
    found: list[dict[str, Any]] = []
    for factor in (2, 4, 8, 16, 32, 64, 128):
        candidate = replace(request, nproc=request.nproc * factor)
        if _training_peak(candidate) <= available:
            found.append(_alternative(request, candidate))
            break
    switches = [replace(request, activation_checkpointing=True)]
    switches += [replace(request, cpu_offload=True)] if not request.on_cpu else []
    switches += [replace(request, lora_r=16)] if not request.lora_r else []
    if request.sequence_parallel == 1 and request.nproc % 2 == 0:  # as FSDP2Config turns the chunked loss on
        switches += [replace(request, sequence_parallel=2, loss_chunk_size=request.loss_chunk_size or 4096)]
    found += [_alternative(request, c) for c in switches if c != request and _training_peak(c) <= available]
    return found


def _alternative(before: PlanRequest, after: PlanRequest) -> dict[str, Any]:
    """One alternative as the plan reports it: what changed, and the training peak it gives."""
    return {"change": _describe_change(before, after), "training_peak": _training_peak(after)}


@functools.lru_cache(maxsize=64)
def _training_peak(request: PlanRequest) -> int:
    """The training peak of one candidate; cached, as the search asks again for the ones it reports."""
    sizes = model_sizes(request)
    phases = phases_for(request, sizes, cached_activations(request))
    return next(p for p in phases if p.name == "training").total


def _describe_change(before: PlanRequest, after: PlanRequest) -> str:
    """The fields `after` changes, as `name=value` pairs."""
    changed = [f"{k}={v}" for k, v in asdict(after).items() if asdict(before)[k] != v]
    return ", ".join(changed)
