"""Each phase's per-rank peak: arithmetic over the model's sizes and its activations, traced on fake tensors (or,
at the trainer's start, bounded from above).

What this pipeline holds in each phase:
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
added as measured, and from training on the all-gather buffers kept between steps (`comm_buffers`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch

from ..adapters.nf4 import NF4_BYTES_PER_ELEMENT
from ..optim.state_sizes import STEP_TEMPORARIES, state_bytes
from .model_sizes import ModelSizes, lora_config, model_sizes, skeleton_sizes
from .plan_types import Phase, PlanRequest

# What a rank's resident set grows by, above the after-import baseline, beyond the tensors: library code paged
# in on first use, the process group, DCP planning. Measured with scripts/measure/validate_plan.py's worker on an 8 MiB
# Llama (1 layer, hidden 64) on this project's CPU machine: 18-23 MiB after loading at 1, 2 and 4 ranks.
# A GPU's own fixed cost (the CUDA context) is outside torch's allocated memory and is not counted.
CPU_RUNTIME_BYTES = 18 * 2**20


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


def _activations(request: PlanRequest, sizes: ModelSizes, lora: Any) -> int:
    """Traced activation bytes at the per-device batch, in the compute dtype."""
    from .activation_trace import traced_activation_bytes

    compute = torch.bfloat16 if request.bf16 else sizes.load_dtype
    blocks = sizes.block_classes if request.activation_checkpointing else None
    return traced_activation_bytes(
        sizes.config, compute, request.batch, request.seq, blocks, lora, request.loss_chunk_size,
        request.sequence_parallel, sizes.block_classes if request.compile else None,
    )  # fmt: skip


def cached_activations(request: PlanRequest) -> int:
    """Activations do not depend on the number of ranks, offload or the optimizer: trace each other case once."""
    return _activations_of(replace(request, nproc=1, hsdp=1, cpu_offload=False, device_memory=None, optim="sgd"))


@functools.lru_cache(maxsize=32)
def _activations_of(request: PlanRequest) -> int:
    """One trace per distinct case (see `cached_activations`): each costs tens of ms per layer."""
    return _activations(request, model_sizes(request), lora_config(request) if request.lora_r else None)
