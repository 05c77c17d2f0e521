"""`hf_fsdp2.plan`: what each rank will hold in each phase of a run, before launching it; and the same plan,
logged at the trainer's start beside the memory each rank has.

Everything is derived from the model's config on the meta device (nothing but config.json is read) and
from what this pipeline does in each phase (`phases`). Figures are validated against measurement by
`scripts/measure/validate_plan.py`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..optim.state_sizes import PLANNED
from .alternatives import alternatives
from .model_sizes import model_sizes
from .phases import cached_activations, phases_for, training_peak_of
from .plan_table import gib
from .plan_types import DEFAULT_LORA_TARGETS, MemoryPlan, PlanRequest


def plan(
    model: str | os.PathLike | nn.Module,
    nproc: int = 1,
    hsdp: int = 1,
    bf16: bool = False,
    lora_r: int | None = None,
    lora_targets: tuple[str, ...] | str = DEFAULT_LORA_TARGETS,
    batch: int = 1,
    seq: int = 512,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    optim: str = "adamw_torch_fused",
    device_memory: int | None = None,
    cpu: bool | None = None,
    qlora: bool = False,
    loss_chunk_size: int | None = None,
    sequence_parallel: int = 1,
    generate_tokens: int = 0,
    compile: bool = False,
) -> MemoryPlan:
    """Plan a run of `model` (a folder, a config.json, or the model object itself: a PreTrainedModel, a meta
    skeleton or a PeftModel, whose LoRA rank and targets are used unless `lora_r` is given): per-rank bytes
    per phase, verdict, alternatives.

    Raises:
        ValueError: for an optimizer without a known state size, ranks that HSDP cannot split, or
            `cpu_offload` on a machine without accelerators (the trainer refuses it there).
    """
    targets = lora_targets if isinstance(lora_targets, str) else tuple(lora_targets)
    if qlora and lora_r is None and not isinstance(model, nn.Module):
        raise ValueError("qlora=True trains LoRA adapters on a 4-bit base: give lora_r (CLI: --lora r=16,...).")
    request = PlanRequest(
        "", nproc, hsdp, bf16, lora_r, targets, batch, seq, activation_checkpointing,
        cpu_offload, optim, device_memory, cpu, qlora=qlora, loss_chunk_size=loss_chunk_size,
        sequence_parallel=sequence_parallel, generate_tokens=generate_tokens, compile=compile,
    )  # fmt: skip
    if isinstance(model, nn.Module):
        request = _request_for_object(request, model)
    else:
        request = replace(request, model=os.fspath(model))
    return plan_request(request)


def _request_for_object(request: PlanRequest, model: nn.Module) -> PlanRequest:
    """Describe a model object by its config (and its active LoRA adapter, unless lora_r says otherwise)."""
    base, lora = _base_and_lora(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(
            f"{type(model).__name__} has no Hugging Face config to plan from; pass its model folder or config.json."
        )
    if lora is not None and request.lora_r is None:
        targets = lora.target_modules
        request = replace(
            request, lora_r=lora.r, lora_targets=targets if isinstance(targets, str) else tuple(sorted(targets))
        )
    name = f"{type(model).__name__.removeprefix('FSDP')} ({config.model_type})"
    return replace(request, model=name, config=config, config_key=config.to_json_string())


def plan_request(request: PlanRequest) -> MemoryPlan:
    """`plan` for a PlanRequest; the alternatives are planned the same way."""
    _validate(request)
    sizes = model_sizes(request)
    try:
        activations, not_traced = cached_activations(request), None
    except Exception as error:  # NOTE: the plan is advice: a model the fake trace cannot run still gets the rest
        activations, not_traced = 0, f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    phases = phases_for(request, sizes, activations)
    training = next(p for p in phases if p.name == "training").total
    available = request.device_memory or detect_device_memory(request.nproc)
    result = MemoryPlan(request, phases, available, training, training <= available, not_traced=not_traced)
    if not result.fits and not_traced is None:
        result.alternatives = alternatives(request, available)
    return result


def _validate(request: PlanRequest) -> None:
    """Refuse a request no run could make, before any counting (see `plan`'s Raises)."""
    if request.cpu_offload and request.on_cpu:
        raise ValueError(
            "cpu_offload: a run without accelerators has nothing to offload (FSDP2Trainer refuses it there); plan "
            "without it, or plan a GPU run from this machine with --gpu (plan(..., cpu=False))."
        )
    if request.optim not in PLANNED:
        raise ValueError(f"--optim {request.optim!r}: the planner knows {PLANNED}.")
    if request.nproc < 1 or request.hsdp < 1 or request.nproc % request.hsdp:
        raise ValueError(f"--hsdp {request.hsdp} must divide --nproc {request.nproc} (both >= 1).")
    if request.sequence_parallel < 1 or request.nproc % request.sequence_parallel:
        raise ValueError(
            f"--sequence-parallel {request.sequence_parallel} must divide --nproc {request.nproc} (both >= 1)."
        )


def detect_device_memory(nproc: int) -> int:
    """This machine's accelerator memory, or its RAM shared by `nproc` ranks when it has none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return total_kib * 1024 // nproc


def log_memory_plan(model: nn.Module, args: Any, config: Any, dataset: Any, optim: str | None = None) -> None:
    """Log the planned training peak per rank beside the memory available; warn when it will not fit.

    For a causal LM whose batches hold `input_ids` (the sequence length is the first example's). A model
    the planner cannot describe is named in an info line instead: a log line never stops training.
    """
    import torch.distributed as dist

    from ..adapters.nf4 import is_nf4
    from ..distributed import log_rank0, warn_rank0

    try:
        seq = len(dataset[0]["input_ids"])
        nproc = dist.get_world_size() if dist.is_initialized() else 1
        # fp16 compute holds what bf16 compute holds (2 bytes a value, fp32 masters): planned as bf16.
        request = PlanRequest(
            "", nproc=nproc, hsdp=config.hsdp_replicate_size, bf16=bool(args.bf16 or args.fp16),
            batch=args.per_device_train_batch_size, seq=seq, cpu_offload=config.cpu_offload,
            activation_checkpointing=config.fsdp_activation_checkpointing or bool(args.gradient_checkpointing),
            optim=optim or str(getattr(args.optim, "value", args.optim)),
            qlora=any(is_nf4(p) for p in model.parameters()), loss_chunk_size=config.effective_loss_chunk_size,
            sequence_parallel=config.sequence_parallel_size, compile=config.compile,
        )  # fmt: skip
        _validate(request)
        base, lora = _base_and_lora(model)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(request.nproc)))
        available = detect_device_memory(local)
        # NOTE: a trace can only lower the figure, so where the generous bound already fits, tracing could not
        # change the verdict and would only sharpen a log line: it costs about 45 ms per layer on rank 0 while
        # every other rank waits (1.0-1.1 s of a 1.2B Llama's 5.3-6.1 s load at 2 CPU ranks, wall-clock marks).
        peak, traced = training_peak_of(request, base.config, lora, below=available)
    except Exception as error:  # NOTE: the plan is advice; any model it cannot describe trains as before
        log_rank0("No memory plan for this run (%s: %s).", type(error).__name__, error)
        return
    if not traced:
        log_rank0(
            "Memory plan: training needs at most %s per rank (batch %d × seq %d; activations bounded, not traced: "
            "`hf-fsdp2 plan` traces them); %s available per rank.",
            gib(peak), request.batch, request.seq, gib(available),
        )  # fmt: skip
    elif peak > available:
        warn_rank0(
            "Memory plan: training needs about %s per rank (batch %d × seq %d) but %s is available per rank: "
            "it will not fit. `hf-fsdp2 plan` shows what would (more ranks, activation checkpointing, LoRA).",
            gib(peak), request.batch, request.seq, gib(available),
        )  # fmt: skip
    else:
        log_rank0(
            "Memory plan: training needs about %s per rank (batch %d × seq %d); %s available per rank.",
            gib(peak), request.batch, request.seq, gib(available),
        )  # fmt: skip


def _base_and_lora(model: nn.Module) -> tuple[nn.Module, Any]:
    """The base model and the active LoRA config of a PEFT model (None for a plain one)."""
    from ..loading.facts import facts_of

    if not facts_of(model).is_peft:
        return model, None
    from ..adapters.methods import active_adapter

    return model.get_base_model(), model.peft_config[active_adapter(model)]
