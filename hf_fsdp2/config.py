"""FSDP2Config: every choice hf_fsdp2 makes about sharding, precision and memory, in one dataclass.

It validates its own fields and turns string options into torch objects; it knows nothing about
models, process groups or the Trainer. Help text lives in `metadata["help"]` so `HfArgumentParser`
and the docs' configuration reference (docs/reference/config.md) show the same words.
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch

WrapPolicy = Literal["transformer_based_wrap", "size_based_wrap", "no_wrap"]
WRAP_POLICIES: tuple[str, ...] = get_args(WrapPolicy)
CheckpointWrites = Literal["cached", "direct"]
CHECKPOINT_WRITES: tuple[str, ...] = get_args(CheckpointWrites)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_BOOL_STRINGS = {"true": True, "false": False}
# Tokens per loss chunk when sequence parallelism turns the chunked loss on: 4096 x a 128k vocabulary in fp32 is
# 2 GiB, against 32 GiB for a 64k-token row's full logits.
DEFAULT_SEQUENCE_PARALLEL_LOSS_CHUNK = 4096


@dataclass
class FSDP2Config:
    """How `FSDP2Trainer` shards, casts and checkpoints the model.

    The fields serve five jobs, the groups of the Configuration page (`GROUPS` in scripts/docs/config_reference.py):
    sharding; precision and memory; the training step; checkpoints and preemption; export. They stay in the order
    they were added here, because that order is the positional one and `HfArgumentParser`'s `--help`.
    """

    # NOTE: annotated for HfArgumentParser (which drops `str` from unions); in Python a callable
    # module -> bool is accepted too.
    auto_wrap_policy: WrapPolicy = field(  # type: ignore[assignment]
        default="transformer_based_wrap",
        metadata={
            "help": "Which modules become FSDP units (each all-gathered and freed on its own): "
            "'transformer_based_wrap' (every module whose class is in transformer_layer_cls_to_wrap), "
            "'size_based_wrap' (the smallest modules holding at least min_num_params parameters), "
            "'no_wrap' (one unit: the whole model), or a callable module -> bool."
        },
    )
    transformer_layer_cls_to_wrap: list[str] | None = field(
        default=None,
        metadata={
            "help": "Class names of the blocks to wrap with 'transformer_based_wrap'. "
            "Default: the model's `_no_split_modules` (e.g. ['LlamaDecoderLayer']); a model that declares none "
            "(a plain nn.Module) gets size-based units (min_num_params), else one unit for the whole model. "
            "Names given here must match a module, or sharding fails listing the model's classes."
        },
    )
    min_num_params: int = field(
        default=100_000_000,
        metadata={
            "help": "Parameter count from which a module becomes a unit under 'size_based_wrap' (and under "
            "'transformer_based_wrap' for a model that declares no blocks)."
        },
    )
    branch_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Sub-modules (dotted names) that a rank may skip in a step while another runs them, beyond "
            "those found by structure (a multimodal model's image/audio encoders and projectors, skipped on a "
            "text-only batch). They are kept in the root unit and given zero gradients where they did not run, "
            "so ranks never disagree on a collective. See the docs' 'VLMs and MoE' page."
        },
    )
    base_quantization: str | None = field(
        default=None,
        metadata={
            "help": "'nf4': QLoRA — the frozen base's linear weights become 4-bit NF4 (torchao's NF4Tensor, not "
            "bitsandbytes' kernels), each rank quantizing only its own rows, bit-equal to quantizing the whole "
            "tensor; FSDP2 gathers them in 4 bits. Weights that cannot split into whole NF4 blocks at this world size, "
            "the head and embeddings by their role, whatever their names (get_output_embeddings(), "
            "get_input_embeddings(); without a declared head, the last module) and tied weights stay dense and are "
            "listed in the log. Needs the 'qlora' extra. Also set "
            "by from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4'))."
        },
    )
    reshard_after_forward: str = field(
        default="true",
        metadata={
            "help": "Free gathered parameters after each unit's forward ('true': least memory, gathers again in "
            "backward), keep them ('false': faster, ZeRO-2-like), or an int N: reshard to groups of N ranks "
            "(must divide the shard group size). Python's True/False/int are accepted and stored as these "
            "strings; `reshard_policy` gives the value for fully_shard. The root unit is never resharded after "
            "forward, nor with 'true' the last block: backward needs both first, so resharding would only gather "
            "them again."
        },
    )
    param_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Dtype of the gathered parameters used in forward/backward: 'bfloat16', 'float16', 'float32'. "
            "Default: 'bfloat16' when TrainingArguments.bf16 is set, 'float16' with TrainingArguments.fp16 "
            "(FSDP2Trainer then scales the loss with a gradient scaler every rank agrees on), else the parameters' "
            "own dtype. "
            "Trainable parameters are always kept as float32 masters when this is lower precision."
        },
    )
    reduce_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Dtype gradients are reduced (reduce-scatter / all-reduce) in. Default: 'float32' "
            "whenever mixed precision is on."
        },
    )
    cpu_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep sharded parameters, gradients and optimizer state in host memory and run the optimizer "
            "step on the CPU (torch's CPUOffloadPolicy). Saves accelerator memory, costs speed."
        },
    )
    fsdp_activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute each wrapped block's activations in backward instead of storing them. "
            "Applied per unit, before compile and sharding; parameter names do not change. (Named apart from "
            "TrainingArguments.activation_checkpointing, transformers' own, so both parse in one HfArgumentParser.)"
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each wrapped block (after activation checkpointing, before sharding). generate() "
            "runs these blocks eagerly: decoding would recompile them for every token length and layer."
        },
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Causal LMs: while training, compute the LM head and cross entropy over chunks of this many "
            "tokens, each chunk's logits recomputed in backward, so the loss holds chunk x vocabulary logits "
            "instead of sequence x vocabulary (e.g. 4096). Same loss up to summation order. Models whose forward "
            "changes the logits before the loss (soft-capping, scaling), label smoothing, a compute_loss_func or "
            "a Trainer subclass with its own compute_loss train unchunked, with one log line."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Long rows: groups of N consecutive ranks share each row, each holding a contiguous 1/N of its "
            "tokens (Ulysses attention: two all-to-alls around each attention call). The global batch, steps and "
            "losses stay those of the same ranks without it; activation memory per rank drops about N times. "
            "Exact with packed rows (DataCollatorWithFlattening, TRL packing / padding_free). Causal LMs of the "
            "families in the README; N must divide the world size and the attention heads. Turns on loss_chunk_size "
            "(4096) unless set. Evaluation and generate run unsplit."
        },
    )
    gather_for_generate: bool = field(
        default=True,
        metadata={
            "help": "generate() on the sharded model (yours, Seq2SeqTrainer's, TRL's) gathers every unit once per "
            "call and reshards after, instead of once per new token: much faster, and holds the whole model in its "
            "compute dtype on each rank while it runs. When that would not fit, it gathers per token, saying so "
            "once. False: always per token (least memory). For your own inference: `with hf_fsdp2.gathered(model)`."
        },
    )
    defer_gradient_sync: bool = field(
        default=False,
        metadata={
            "help": "With gradient_accumulation_steps > 1: keep unreduced, unsharded gradients across micro-steps "
            "and reduce once per optimizer step (less communication, more memory). Default: reduce every "
            "micro-step (least memory)."
        },
    )
    hsdp_replicate_size: int = field(
        default=1,
        metadata={
            "help": "Number of replicas for HSDP: > 1 builds a 2-D mesh (replicate x shard), sharding within "
            "groups of world_size / hsdp_replicate_size ranks (usually: one node) and replicating across them."
        },
    )

    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write checkpoints in the background: training continues at once while the state is copied to "
            "host memory (buffers kept from save to save); the next optimizer step waits for that copy, the next save "
            "or the end of training for a write still running. The folder appears under its checkpoint-N name at "
            "the end of the first step after every rank has written it, never before."
        },
    )
    checkpoint_writes: CheckpointWrites = field(
        default="cached",
        metadata={
            "help": "How sharded checkpoints reach the disk: 'cached' through the page cache (a resume on the same "
            "machine reads them from memory), or 'direct' with O_DIRECT from a background thread (saves measured "
            "2.3-4.6x faster on the development VM's disk, but the files are not left in memory: a resume reads "
            "them from disk, 2.5x slower in the benchmark's save-then-resume). Exports always write 'direct'."
        },
    )
    consolidate_on_train_end: bool = field(
        default=True,
        metadata={
            "help": "At the end of train(), write a from_pretrained-ready folder (model.safetensors, config, "
            "tokenizer) to TrainingArguments.output_dir (hf_fsdp2.ConsolidateCallback); for a PEFT model, "
            "an adapter folder that PeftModel.from_pretrained loads."
        },
    )
    merge_adapters_on_save: bool = field(
        default=False,
        metadata={
            "help": "PEFT models only: save_model and the end-of-training export write the full model with the "
            "active LoRA adapter merged into copies of the base weights (from_pretrained-ready) instead of "
            "the adapter folder. Checkpoints stay adapter-only."
        },
    )
    export_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Dtype of exported Hugging Face folders (save_model, end of training, save_pretrained), e.g. "
            "'bfloat16'. Default: the dtype each parameter was loaded in (float32 masters of a bfloat16 checkpoint "
            "are written in bfloat16 again, as save_pretrained of the loaded model would); the offline "
            "`hf-fsdp2 consolidate` writes what the checkpoint stores unless given --dtype."
        },
    )
    max_shard_size: str = field(
        default="5GB",
        metadata={"help": "Largest safetensors file in exported folders (e.g. '5GB', '500MB')."},
    )

    checkpoint_on_signals: list[str] = field(
        default_factory=lambda: ["SIGTERM"],
        metadata={
            "help": "Signals that mean 'you are being preempted' (SLURM: add SIGUSR1 with --signal=USR1@90). "
            "Every rank finishes its step, all agree, the step reached is checkpointed synchronously and "
            "train() exits with code 128 + signal; relaunch with resume_from_checkpoint='auto'. [] (CLI: none) "
            "turns it off."
        },
    )
    signal_check_steps: int = field(
        default=1,
        metadata={
            "help": "Optimizer steps between two checks for a signal (each check all-reduces one integer over a "
            "CPU group; see the benchmark for its cost). A signal is acted on at the next check."
        },
    )
    float8: bool = field(
        default=False,
        metadata={
            "help": "Train the Linear layers through FP8 matmuls (torchao's float8, tensorwise scales): each rank "
            "casts its shard of a weight to FP8 and FSDP2 all-gathers the FP8 bytes; the masters, optimizer and "
            "checkpoints stay as without it. Layers too small for FP8 to pay (torchao's filter) and the head compute "
            "in bf16 as without it. Needs TrainingArguments(bf16=True), a GPU with FP8 tensor cores (compute "
            "capability 8.9+: L4, L40S, H100, H200, B200) and torchao; refused on the CPU, with cpu_offload, an NF4 "
            "base or a PEFT model. Pair it with compile=True (torchao's casts are fused only when compiled)."
        },
    )

    def __post_init__(self) -> None:
        """Normalize CLI strings and reject bad values before any collective runs."""
        # NOTE: a str field, because HfArgumentParser parses no bool-or-int union; stored in one spelling.
        self.reshard_after_forward = str(_parse_reshard(self.reshard_after_forward)).lower()
        if self.checkpoint_writes not in CHECKPOINT_WRITES:
            raise ValueError(
                f"checkpoint_writes={self.checkpoint_writes!r} is not valid; choose one of {list(CHECKPOINT_WRITES)}."
            )
        if not callable(self.auto_wrap_policy) and self.auto_wrap_policy not in WRAP_POLICIES:
            raise ValueError(
                f"auto_wrap_policy={self.auto_wrap_policy!r} is not valid; choose one of {list(WRAP_POLICIES)} "
                "or pass a callable (module) -> bool."
            )
        if isinstance(self.transformer_layer_cls_to_wrap, str):
            self.transformer_layer_cls_to_wrap = [
                name.strip() for name in self.transformer_layer_cls_to_wrap.split(",") if name.strip()
            ]
        if self.transformer_layer_cls_to_wrap is not None and not self.transformer_layer_cls_to_wrap:
            raise ValueError(
                "transformer_layer_cls_to_wrap=[] names no class; leave it None to use the model's "
                "_no_split_modules, or name the block classes (e.g. ['LlamaDecoderLayer'])."
            )
        if isinstance(self.branch_modules, str):
            self.branch_modules = [name.strip() for name in self.branch_modules.split(",") if name.strip()]
        if self.base_quantization not in (None, "nf4"):
            raise ValueError(
                f"base_quantization={self.base_quantization!r} is not supported; use 'nf4' (QLoRA) or leave it None."
            )
        if self.float8 and self.base_quantization == "nf4":
            raise ValueError(
                "float8=True with base_quantization='nf4': the frozen base is stored in 4 bits, float8 trains "
                "full-precision weights through FP8 matmuls. Choose one: QLoRA without float8, or a full fine-tune "
                "with it."
            )
        if self.float8 and self.cpu_offload:
            raise ValueError(
                "float8=True with cpu_offload=True is not supported: FSDP2 would copy each host shard to the GPU and "
                "torchao would cast it to FP8 there at every all-gather, one amax all-reduce per weight, a combination "
                "no test or GPU run here has covered. Use one of the two."
            )
        if self.min_num_params < 1:
            raise ValueError(f"min_num_params={self.min_num_params} must be >= 1 (a parameter count).")
        for name in ("param_dtype", "reduce_dtype", "export_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"{name}={value!r} is not valid; choose one of {list(DTYPES)} or leave it None.")
        if self.reduce_dtype == "float16":
            raise ValueError(
                "reduce_dtype='float16' is not supported: gradients summed over ranks in float16 overflow or "
                "underflow. Leave it unset (float32 whenever compute is in lower precision)."
            )
        parse_size(self.max_shard_size)
        # NOTE: "none" lets a command line (which cannot pass an empty list) turn the checkpoint off.
        if isinstance(self.checkpoint_on_signals, str):
            self.checkpoint_on_signals = [self.checkpoint_on_signals]
        # key=value overrides give one comma-separated string: checkpoint_on_signals=SIGTERM,SIGUSR1
        names = [n for entry in self.checkpoint_on_signals for n in str(entry).split(",")]
        names = [n for n in names if n.strip().lower() not in ("", "none")]
        self.checkpoint_on_signals = list(dict.fromkeys(_signal_name(name) for name in names))
        if not isinstance(self.signal_check_steps, int) or self.signal_check_steps < 1:
            raise ValueError(f"signal_check_steps={self.signal_check_steps!r} must be an int >= 1 (optimizer steps).")
        if self.loss_chunk_size is not None and (not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size < 1):
            raise ValueError(f"loss_chunk_size={self.loss_chunk_size!r} must be an int >= 1 (tokens) or None (off).")
        if not isinstance(self.sequence_parallel_size, int) or self.sequence_parallel_size < 1:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size!r} must be an int >= 1 (1 = off; N = ranks "
                "sharing each row)."
            )
        if not isinstance(self.hsdp_replicate_size, int) or self.hsdp_replicate_size < 1:
            raise ValueError(
                f"hsdp_replicate_size={self.hsdp_replicate_size!r} must be an int >= 1 "
                "(1 = plain FSDP; N > 1 = N replicas of a sharded model)."
            )

    @property
    def effective_loss_chunk_size(self) -> int | None:
        """`loss_chunk_size`, or its default under sequence parallelism (long rows are why it is on)."""
        if self.loss_chunk_size is None and self.sequence_parallel_size > 1:
            return DEFAULT_SEQUENCE_PARALLEL_LOSS_CHUNK
        return self.loss_chunk_size

    @property
    def reshard_policy(self) -> bool | int:
        """`reshard_after_forward` as fully_shard takes it: True, False or a group size."""
        return _parse_reshard(self.reshard_after_forward)

    def to_summary(self) -> dict[str, Any]:
        """Return the fields as plain values, so ranks can compare configs before the first collective."""
        summary = asdict(self)
        if callable(self.auto_wrap_policy):
            summary["auto_wrap_policy"] = getattr(self.auto_wrap_policy, "__qualname__", "callable")
        return summary


def _parse_reshard(value: bool | int | str) -> bool | int:
    """Accept True/False/int, and their spellings on a command line."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _BOOL_STRINGS:
            return _BOOL_STRINGS[lowered]
        if lowered.isdigit():
            value = int(lowered)
        else:
            raise ValueError(f"reshard_after_forward={value!r} is not valid; use true, false or a positive int.")
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 1:
        return value
    raise ValueError(f"reshard_after_forward={value!r} is not valid; use True, False or a positive int.")


def _signal_name(name: str) -> str:
    """`SIGTERM`, `TERM`, `sigusr1`, `15` → the canonical name; refuse what cannot be handled."""
    text = str(name).strip().upper()
    try:
        sig = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
        )
    except (KeyError, ValueError):
        raise ValueError(
            f"checkpoint_on_signals: {name!r} is not a signal; use names such as SIGTERM or SIGUSR1."
        ) from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"checkpoint_on_signals: {sig.name} cannot be caught by any process; remove it.")
    return sig.name


def resolve_dtype(name: str | None) -> torch.dtype | None:
    """Map a config dtype name to a torch dtype (None stays None)."""
    return None if name is None else DTYPES[name]


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
    """Turn '5GB', '500MB' or a byte count into bytes.

    Raises:
        ValueError: when `size` is a string that is not a size such as '5GB' or '500MB'.
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r} is not a size; use e.g. '5GB', '500MB' or a number of bytes.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
