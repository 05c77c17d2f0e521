"""`hf_fsdp2.plan`: what each rank will hold in each phase of a run, before launching it.

Everything is derived from the model's config on the meta device (nothing but config.json is read) and
from what this pipeline does in each phase:
- load: this rank's shards (trainable ones as fp32 masters under bf16; slices are read straight into
  them), the replicated buffers, and the tensors no checkpoint holds (LoRA adapters), drawn full;
- training: sharded parameters, gradients and optimizer state; the root unit (kept gathered through
  forward and backward), two gathered blocks (the one computing and the one prefetched) plus the
  unsharded gradients and reduce-scatter input of one block; activations from a fake-tensor trace of
  one forward/backward at the per-device batch (`activation_trace`); the optimizer step's temporaries;
- checkpoint save: training state plus one tensor's serialization (sync), or a host copy of this rank's
  model and optimizer shards (async staging);
- export (`save_model`, end of training): one gathered full tensor on every rank, plus rank 0's copy;
- offline consolidation: one process, about twice the largest tensor.
On a machine without accelerators each rank's process runtime (libraries paged in, the process group) is
added as measured, and from training on the all-gather buffers kept between steps (`comm_buffers`). Figures are
validated against measurement by `scripts/measure/validate_plan.py`.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..adapters.nf4 import NF4_BYTES_PER_ELEMENT
from ..loading.skeleton import auto_class_for
from ..optim.state_sizes import PLANNED, STEP_TEMPORARIES, state_bytes

GIB = 2**30
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# What a rank's resident set grows by, above the after-import baseline, beyond the tensors: library code paged
# in on first use, the process group, DCP planning. Measured with scripts/measure/validate_plan.py's worker on an 8 MiB
# Llama (1 layer, hidden 64) on this project's CPU machine: 18-23 MiB after loading at 1, 2 and 4 ranks.
# A GPU's own fixed cost (the CUDA context) is outside torch's allocated memory and is not counted.
CPU_RUNTIME_BYTES = 18 * 2**20


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


@dataclass
class ModelSizes:
    """What the arithmetic needs from the model: element counts and bytes, by role."""

    params_bytes: int  # every parameter as stored on a rank before sharding (fp32 masters counted at 4 bytes)
    trainable_numel: int
    trainable_bytes: int  # as stored (fp32 masters under bf16)
    buffers_bytes: int
    largest_tensor_bytes: int  # as stored in the checkpoint
    largest_unit_numel: int
    largest_unit_trainable_numel: int
    root_numel: int
    new_bytes: int  # tensors no base checkpoint holds (LoRA adapters), as loading initializes them
    block_classes: list[str]
    config: Any = None
    load_dtype: torch.dtype = torch.float32
    # Set when transformers must convert the checkpoint's keys (fused MoE experts, renamed VLM modules): loading
    # then builds the whole model on rank 0 and sends it out (see `loading.choose_route`); its bytes as loaded.
    rank0_load_bytes: int = 0
    # QLoRA: NF4 elements in the largest unit, and the largest NF4 weight (dequantized whole in each F.linear).
    largest_unit_nf4_numel: int = 0
    largest_nf4_numel: int = 0
    # Shapes of the trainable parameters, and of those hf_fsdp2.Muon gives to Muon (optimizer state by real size);
    # none given: the trainable elements count as one vector.
    trainable_shapes: tuple[tuple[int, ...], ...] = ()
    muon_shapes: tuple[tuple[int, ...], ...] = ()
    params_numel: int = 0  # every parameter's elements (the gathered model of generate)


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
        activations, not_traced = _cached_activations(request), None
    except Exception as error:  # NOTE: the plan is advice: a model the fake trace cannot run still gets the rest
        activations, not_traced = 0, f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    phases = phases_for(request, sizes, activations)
    training = next(p for p in phases if p.name == "training").total
    available = request.device_memory or detect_device_memory(request.nproc)
    result = MemoryPlan(request, phases, available, training, training <= available, not_traced=not_traced)
    if not result.fits and not_traced is None:
        result.alternatives = _alternatives(request, available)
    return result


def _validate(request: PlanRequest) -> None:
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


def load_config(model: str) -> Any:
    """The model's config from a folder or a config.json file.

    Raises:
        ValueError: when there is no config.json at `model`.
    """
    from transformers import AutoConfig

    path = os.path.dirname(model) if model.endswith(".json") else model
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{model}: no config.json there; pass a model folder or its config.json.")
    return AutoConfig.from_pretrained(path)


def model_sizes(request: PlanRequest) -> ModelSizes:
    """Count parameters by role on a meta skeleton of the request's config (with its LoRA adapters)."""
    config = request.config if request.config is not None else load_config(request.model)
    shards = request.nproc // request.hsdp if request.qlora else None
    return skeleton_sizes(config, _lora_config(request) if request.lora_r else None, request.bf16, shards)


def skeleton_sizes(config: Any, lora: Any, bf16: bool, nf4_shards: int | None = None) -> ModelSizes:
    """Count parameters by role on a meta skeleton of `config`, wrapped with the peft `lora` config if given;
    with `nf4_shards`, the weights that are NF4 at that shard count are counted in NF4 bytes (QLoRA)."""
    from ..adapters.nf4 import nf4_candidates
    from ..config import FSDP2Config
    from ..loading.weights import needs_conversion
    from ..optim.muon_routing import split_for_muon
    from ..sharding.units import block_classes, select_units

    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    with torch.device("meta"):
        model: nn.Module = auto_class_for(config).from_config(config, dtype=dtype)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(lora))
    units = select_units(model, FSDP2Config())
    converted = needs_conversion(model) is not None
    in_units = {id(p) for unit in units for p in unit.parameters()}
    stored: dict[int, float] = {id(p): _stored_bytes(p, bf16) for p in model.parameters()}
    nf4_names = nf4_candidates(model, nf4_shards)[0] if nf4_shards else []
    nf4 = {id(model.get_parameter(n)): model.get_parameter(n) for n in nf4_names}
    stored.update(dict.fromkeys(nf4, NF4_BYTES_PER_ELEMENT))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelSizes(
        params_bytes=int(sum(p.numel() * stored[id(p)] for p in model.parameters())),
        params_numel=sum(p.numel() for p in model.parameters()),
        trainable_numel=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * stored[id(p)] for p in trainable),
        buffers_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        largest_tensor_bytes=max(p.numel() * p.element_size() for p in model.parameters()),
        largest_unit_numel=max((sum(p.numel() for p in unit.parameters()) for unit in units), default=0),
        largest_unit_trainable_numel=max(
            (sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in units), default=0
        ),
        root_numel=sum(p.numel() for p in model.parameters() if id(p) not in in_units),
        new_bytes=sum(p.numel() * p.element_size() for p in trainable) if lora is not None else 0,
        block_classes=block_classes(model, FSDP2Config()),
        config=config,
        load_dtype=dtype,
        rank0_load_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) if converted else 0,
        largest_unit_nf4_numel=max((sum(p.numel() for p in u.parameters() if id(p) in nf4) for u in units), default=0),
        largest_nf4_numel=max((p.numel() for p in nf4.values()), default=0),
        trainable_shapes=tuple(tuple(p.shape) for p in trainable),
        muon_shapes=tuple(tuple(p.shape) for p in split_for_muon(model)[0]),
    )


def training_peak_of(request: PlanRequest, config: Any, lora: Any, below: int | None = None) -> tuple[int, bool]:
    """The training peak of a run whose model is given as a config (and peft LoRA config) instead of a path, and
    whether it was traced. With `below`, a peak that an upper bound on the activations already keeps under it is
    given as that bound, untraced: the trace costs about 60 ms per layer on a CPU core, at every start."""
    sizes = skeleton_sizes(config, lora, request.bf16)
    bound = activation_bound(request, sizes.config)
    if below is not None and bound is not None:
        peak = next(p for p in phases_for(request, sizes, bound) if p.name == "training").total
        if peak <= below:
            return peak, False
    activations = _activations(request, sizes, lora)
    return next(p for p in phases_for(request, sizes, activations) if p.name == "training").total, True


def activation_bound(request: PlanRequest, config: Any) -> int | None:
    """A generous upper bound on a decoder-only text model's activation bytes (None for other models, which are
    always traced): per layer 16 hidden-sized and 8 MLP-sized fp32 tensors per token plus three fp32 attention
    score matrices (eager attention), every layer's when nothing is recomputed; fp32 logits four times over;
    the weight-gradient temporaries the backward holds."""
    if getattr(config, "is_encoder_decoder", False) or config.get_text_config() is not config:
        return None
    tokens = request.batch * request.seq
    hidden, heads = config.hidden_size, config.num_attention_heads
    mlp = (getattr(config, "intermediate_size", None) or 4 * hidden) + (
        getattr(config, "moe_intermediate_size", 0) or 0
    ) * (getattr(config, "num_experts_per_tok", 0) or 0)
    layer = tokens * (16 * hidden + 8 * mlp) * 4 + 3 * request.batch * heads * request.seq**2 * 4
    layers = config.num_hidden_layers
    kept = layers * layer if not request.activation_checkpointing else layers * tokens * hidden * 4 * 2 + layer
    logit_tokens = min(request.seq, request.loss_chunk_size or request.seq) * request.batch
    # The trace also holds weight-gradient temporaries: the embedding's and head's, and a block's.
    weight_grads = 4 * config.vocab_size * hidden * 4 + 2 * (4 * hidden * hidden + 3 * hidden * mlp) * 4
    return kept + 4 * logit_tokens * config.vocab_size * 4 + 4 * tokens * hidden * 4 + weight_grads


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
            _gib(peak), request.batch, request.seq, _gib(available),
        )  # fmt: skip
    elif peak > available:
        warn_rank0(
            "Memory plan: training needs about %s per rank (batch %d × seq %d) but %s is available per rank: "
            "it will not fit. `hf-fsdp2 plan` shows what would (more ranks, activation checkpointing, LoRA).",
            _gib(peak), request.batch, request.seq, _gib(available),
        )  # fmt: skip
    else:
        log_rank0(
            "Memory plan: training needs about %s per rank (batch %d × seq %d); %s available per rank.",
            _gib(peak), request.batch, request.seq, _gib(available),
        )  # fmt: skip


def _base_and_lora(model: nn.Module) -> tuple[nn.Module, Any]:
    """The base model and the active LoRA config of a PEFT model (None for a plain one)."""
    from ..loading.facts import facts_of

    if not facts_of(model).is_peft:
        return model, None
    from ..adapters.methods import active_adapter

    return model.get_base_model(), model.peft_config[active_adapter(model)]


def _lora_config(request: PlanRequest) -> Any:
    from peft import LoraConfig

    targets = request.lora_targets
    return LoraConfig(
        r=request.lora_r,
        lora_alpha=2 * request.lora_r,
        target_modules=targets if isinstance(targets, str) else list(targets),
    )


def _stored_bytes(param: torch.Tensor, bf16: bool) -> int:
    """Bytes per element of a parameter's shard: trainable low-precision ones become fp32 masters under bf16."""
    if bf16 and param.requires_grad and param.dtype != torch.float32:
        return 4
    return param.element_size()


def _activations(request: PlanRequest, sizes: ModelSizes, lora: Any) -> int:
    """Traced activation bytes at the per-device batch, in the compute dtype."""
    from .activation_trace import traced_activation_bytes

    compute = torch.bfloat16 if request.bf16 else sizes.load_dtype
    blocks = sizes.block_classes if request.activation_checkpointing else None
    return traced_activation_bytes(
        sizes.config, compute, request.batch, request.seq, blocks, lora, request.loss_chunk_size,
        request.sequence_parallel, sizes.block_classes if request.compile else None,
    )  # fmt: skip


def phases_for(request: PlanRequest, sizes: ModelSizes, activations: int) -> list[Phase]:
    """The per-rank peak of each phase (pure arithmetic over the sizes and the traced activations)."""
    shard = request.nproc // request.hsdp
    compute = 2 if request.bf16 else sizes.load_dtype.itemsize
    reduce = 4
    params = sizes.params_bytes // shard
    grads = sizes.trainable_bytes // shard
    optimizer = _optimizer_state(request.optim, sizes, shard)
    step_temp = STEP_TEMPORARIES.get(request.optim, 1) * grads
    # NOTE: even on one rank FSDP2 all-gathers into separate unsharded parameters.
    # QLoRA: NF4 weights are gathered in 4 bits and dequantized one weight at a time inside F.linear.
    dense_unit = sizes.largest_unit_numel - sizes.largest_unit_nf4_numel
    gathered = (sizes.root_numel + 2 * dense_unit) * compute + sizes.largest_nf4_numel * compute
    gathered += int(2 * sizes.largest_unit_nf4_numel * NF4_BYTES_PER_ELEMENT)
    unit_grads = sizes.largest_unit_trainable_numel * (compute + reduce)
    resident = {"sharded parameters": params, "optimizer state": optimizer, "buffers": sizes.buffers_bytes}
    if request.cpu_offload:
        resident = {"buffers": sizes.buffers_bytes}  # shards and optimizer state live in host memory
    forward_backward = {**resident, "gathered units": gathered + unit_grads, "activations": activations}
    step = {**resident, "gradients": grads if not request.cpu_offload else 0, "optimizer step temporaries": step_temp}
    training = forward_backward if sum(forward_backward.values()) >= sum(step.values()) else step
    runtime = {"process runtime (CPU)": CPU_RUNTIME_BYTES} if request.on_cpu else {}
    # On the CPU the flat all-gather buffers are kept between steps (sharding/comm_buffers.py): the root's and those
    # of the two blocks in flight at once, from the first step on (the reduce-scatter input reuses a block's). A shard
    # group of one makes no all-gather (FSDP2 uses the shard itself), so nothing is kept.
    kept = (sizes.root_numel + 2 * sizes.largest_unit_numel) * compute if request.on_cpu and shard > 1 else 0
    trained = {**runtime, "reused comm buffers (CPU)": kept} if kept else runtime
    # Slices are read straight into the shards (no read buffer: measured); the tensors no checkpoint holds (a
    # LoRA adapter) are drawn full on every rank, and held twice while peft's replay is alive.
    load = {"sharded parameters": params, "buffers": sizes.buffers_bytes, "new tensors, full": 2 * sizes.new_bytes}
    if sizes.largest_nf4_numel:  # each NF4 weight's rows are read dense, then quantized, one weight at a time
        load["one weight's rows before NF4"] = sizes.largest_nf4_numel * sizes.load_dtype.itemsize // shard
    if sizes.rank0_load_bytes:
        # Rank 0's from_pretrained holds the built model and the checkpoint pages it read (measured: 1.96x the
        # model for a Qwen3-MoE); the model stays while the shards are filled from it.
        whole = {"whole model on rank 0 (from_pretrained: model + checkpoint pages read)": 2 * sizes.rank0_load_bytes}
        load = {**whole, "buffers": sizes.buffers_bytes, "new tensors, full": 2 * sizes.new_bytes}
    phases = [
        Phase("load", {**load, **runtime}),
        Phase("training", {**training, **trained}),
        Phase(
            "checkpoint save (sync)", {**resident, "serialized tensor": sizes.largest_tensor_bytes // shard, **trained}
        ),
        Phase("checkpoint save (async staging)", {"host copy of shards": params + optimizer}, where="host"),
        Phase("export (save_model)", {**resident, "gathered tensor": 2 * sizes.largest_tensor_bytes, **trained}),
        Phase("offline consolidation", {"read + write buffers": 2 * sizes.largest_tensor_bytes}, where="host"),
    ]
    if request.generate_tokens:
        gathering, tokens = _generation(request, sizes)
        phases.append(Phase("generation: gathering (once per call)", {**resident, **gathering, **trained}))
        phases.append(Phase("generation: tokens", {**resident, **tokens, **trained}))
    return phases


def _optimizer_state(optim: str, sizes: ModelSizes, shard: int) -> int:
    """Bytes of optimizer state per rank, by each optimizer's real layout (optim.state_sizes)."""
    shapes = sizes.trainable_shapes or ((sizes.trainable_numel,),)
    element = sizes.trainable_bytes / max(sizes.trainable_numel, 1)
    return state_bytes(optim, shapes, element, shard, sizes.muon_shapes)


def _generation(request: PlanRequest, sizes: ModelSizes) -> tuple[dict[str, int], dict[str, int]]:
    """What generate() adds to the resident state while it gathers, then while it makes tokens: the whole model in
    the compute dtype (beside the shards, which stay); while gathering, the all-gather buffers of the unit in
    flight (its whole flat output and this rank's copy-in), the largest when every other unit is already in;
    then the KV cache of prompts + new tokens and the prefill's largest temporaries (one MLP's, fp32 logits of
    the last position)."""
    compute = 2 if request.bf16 else sizes.load_dtype.itemsize
    shard = request.nproc // request.hsdp
    whole = sizes.params_numel * compute
    # Units are gathered root first: the root's buffers come when little else is in, a block's at the end.
    root_in_flight = sizes.root_numel * compute * (2 + 1 / shard) - whole
    block_in_flight = sizes.largest_unit_numel * compute * (1 + 1 / shard)
    text = sizes.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    tokens = request.batch * (request.seq + request.generate_tokens)
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    gathering = {"gathered model": whole, "all-gather buffers of one unit": int(max(root_in_flight, block_in_flight))}
    making_tokens = {
        "gathered model": whole,
        "KV cache": tokens * text.num_hidden_layers * 2 * kv_heads * head_dim * compute,
        "prefill temporaries": request.batch * request.seq * 3 * intermediate * compute
        + request.batch * text.vocab_size * 4,
    }
    return gathering, making_tokens


def detect_device_memory(nproc: int) -> int:
    """This machine's accelerator memory, or its RAM shared by `nproc` ranks when it has none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return total_kib * 1024 // nproc


def _alternatives(request: PlanRequest, available: int) -> list[dict[str, Any]]:
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
    return {"change": _describe_change(before, after), "training_peak": _training_peak(after)}


@functools.lru_cache(maxsize=64)
def _training_peak(request: PlanRequest) -> int:
    sizes = model_sizes(request)
    phases = phases_for(request, sizes, _cached_activations(request))
    return next(p for p in phases if p.name == "training").total


def _cached_activations(request: PlanRequest) -> int:
    """Activations do not depend on the number of ranks, offload or the optimizer: trace each other case once."""
    return _activations_of(replace(request, nproc=1, hsdp=1, cpu_offload=False, device_memory=None, optim="sgd"))


@functools.lru_cache(maxsize=32)
def _activations_of(request: PlanRequest) -> int:
    return _activations(request, model_sizes(request), _lora_config(request) if request.lora_r else None)


def _describe_change(before: PlanRequest, after: PlanRequest) -> str:
    changed = [f"{k}={v}" for k, v in asdict(after).items() if asdict(before)[k] != v]
    return ", ".join(changed)


def format_plan(result: MemoryPlan) -> str:
    """The plan as a readable table: one row per phase, its parts, then the verdict."""
    r = result.request
    lines = [
        f"Plan for {r.model}: {r.nproc} rank(s){f' (HSDP {r.hsdp} replicas)' if r.hsdp > 1 else ''}, "
        f"{'bf16' if r.bf16 else 'checkpoint dtype'}, {f'LoRA r={r.lora_r}' if r.lora_r else 'full fine-tuning'}, "
        f"batch {r.batch} × seq {r.seq} per device, "
        f"activation checkpointing {'on' if r.activation_checkpointing else 'off'}"
        f"{', CPU offload' if r.cpu_offload else ''}"
        f"{f', loss in chunks of {r.loss_chunk_size} tokens' if r.loss_chunk_size else ''}"
        f"{f', rows split across {r.sequence_parallel} ranks' if r.sequence_parallel > 1 else ''}"
        f"{', blocks compiled' if r.compile else ''}, {r.optim}.",
        "",
        "| phase (per rank) | peak | made of |",
        "|---|---:|---|",
    ]
    for phase in result.phases:
        parts = ", ".join(f"{name} {_gib(value)}" for name, value in phase.parts.items() if value >= 2**20)
        where = " (host)" if phase.where == "host" else ""
        lines.append(f"| {phase.name}{where} | {_gib(phase.total)} | {parts} |")
    verdict = "fits" if result.fits else "does NOT fit"
    if result.not_traced is not None:
        lines += [
            "",
            f"Activations could not be traced ({result.not_traced}): the training figures leave them out, so they",
            "are lower bounds and no alternatives are planned. Measure a short run instead",
            "(scripts/measure/validate_plan.py).",
        ]
        verdict = "would fit before activations" if result.fits else "does NOT fit even before activations"
    lines += ["", f"Training peak {_gib(result.training_peak)} per rank {verdict} in {_gib(result.device_memory)}."]
    for alt in result.alternatives:
        lines.append(f"  fits with {alt['change']}: {_gib(alt['training_peak'])}")
    if not result.fits and not result.alternatives and result.not_traced is None:
        lines.append("  no single change fits; combine them (more ranks with activation checkpointing and LoRA).")
    return "\n".join(lines)


def _gib(value: int) -> str:
    """GiB with two decimals from 1 GiB up, whole MiB below."""
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / 2**20:.0f} MiB"
