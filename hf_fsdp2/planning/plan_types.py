"""The planner's vocabulary: the run it is asked about (`PlanRequest`) and its answer, phase by phase
(`Phase`, `MemoryPlan`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class PlanRequest:
    """The run to plan: model, ranks, precision, adapters, batch and the memory-saving switches."""

    model: str
    nproc: int = 1
    hsdp: int = 1
    bf16: bool = False
    lora_r: int | None = None
    lora_targets: tuple[str, ...] | str = DEFAULT_LORA_TARGETS  # names, or peft's regex string
    batch: int = 1
    seq: int = 512
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    optim: str = "adamw_torch_fused"  # Trainer's default
    device_memory: int | None = None
    # A run without accelerators (host RAM, gloo); None: this machine's answer.
    cpu: bool | None = None
    # The config of a model object (plan(model)); `model` then only names it. Its JSON is in `config_key`,
    # so equal configs plan alike and the cached traces never mix two different models.
    config: Any = field(default=None, compare=False, repr=False)
    config_key: str = ""
    # QLoRA: the frozen base's eligible linear weights are 4-bit NF4 (FSDP2Config(base_quantization="nf4")).
    qlora: bool = False
    # FSDP2Config(loss_chunk_size): the LM head and loss over chunks of this many tokens (None: full logits).
    loss_chunk_size: int | None = None
    # FSDP2Config(sequence_parallel_size): N ranks share each row (each traces a slice of seq / N tokens).
    sequence_parallel: int = 1
    # generate() of this many new tokens after prompts of `seq` tokens (0: no generation phase), gathered once.
    generate_tokens: int = 0
    # FSDP2Config(compile=True): each block torch.compiled, keeping what its partitioner saves for backward.
    compile: bool = False

    @property
    def on_cpu(self) -> bool:
        return self.cpu if self.cpu is not None else not torch.cuda.is_available()


@dataclass
class Phase:
    """Peak bytes one rank holds in one phase, and what they are."""

    name: str
    parts: dict[str, int]
    where: str = "device"  # "device" (accelerator, or host RAM without one) or "host"

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryPlan:
    """Per-rank peaks of every phase, the verdict against the memory available and what would fit."""

    request: PlanRequest
    phases: list[Phase]
    device_memory: int
    training_peak: int
    fits: bool
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    # Why the activations could not be traced (the training figure then leaves them out), or None.
    not_traced: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `--json`."""
        return {
            # The config object of a planned model object stays out: `model` names it.
            "request": {k: v for k, v in asdict(self.request).items() if k not in ("config", "config_key")},
            "phases": [{"name": p.name, "where": p.where, "total": p.total, "parts": p.parts} for p in self.phases],
            "device_memory": self.device_memory,
            "training_peak": self.training_peak,
            "fits": self.fits,
            "alternatives": self.alternatives,
            "not_traced": self.not_traced,
        }
