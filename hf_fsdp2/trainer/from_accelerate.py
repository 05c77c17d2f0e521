"""FSDP settings a user already has for Trainer + Accelerate, carried into FSDP2Config.

Read once, where the trainer resolves its FSDP2Config: `TrainingArguments(fsdp=..., fsdp_config=...)`, or the
environment `accelerate launch --use_fsdp ...` exports (`FSDP_*`, `ACCELERATE_MIXED_PRECISION`), both parsed
by Accelerate's own `FullyShardedDataParallelPlugin`. What has an FSDP2Config equivalent becomes its value
unless the user set that field; what cannot carry over (FSDP1, XLA) is refused by name; nothing is dropped
without a word. Knows nothing about models or the Trainer beyond its arguments.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..config import FSDP2Config
from ..distributed import log_rank0, warn_rank0

# FSDP1 settings with no FSDP2 meaning: why, and what to use instead.
FSDP1_ONLY: dict[str, str] = {
    "sharding_strategy": "FSDP2 has no sharding strategies; use reshard_after_forward (true: FULL_SHARD, false: "
    "SHARD_GRAD_OP) and hsdp_replicate_size (HYBRID_SHARD)",
    "backward_prefetch": "FSDP2 prefetches the next unit's all-gather in backward by itself; remove it",
    "forward_prefetch": "FSDP2 schedules forward all-gathers by itself; remove it",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors); remove it",
    "sync_module_states": "hf_fsdp2 loads every rank's slices from the checkpoint (or sends rank 0's weights) "
    "itself; remove it",
    "limit_all_gathers": "an FSDP1 rate limiter; FSDP2 bounds its all-gathers itself; remove it",
}
# Keys that carry over (TrainingArguments.fsdp_config spelling; `accelerate launch` exports FSDP_<KEY>), and
# those that are only about the launcher or are said in the log.
CARRIED_KEYS = {
    "version", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "transformer_cls_to_wrap", "min_num_params",
    "reshard_after_forward", "cpu_offload", "offload_params", "activation_checkpointing", "cpu_ram_efficient_loading",
    "state_dict_type", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "use_fsdp",
}  # fmt: skip
_WRAP_POLICIES = {
    "transformer_auto_wrap_policy": "transformer_based_wrap",
    "size_based_auto_wrap_policy": "size_based_wrap",
}
_STASH = "_hf_fsdp2_accelerate_fsdp"  # the carried settings, kept on TrainingArguments once read
_PARALLELISM_STASH = "_hf_fsdp2_parallelism_config"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FSDP2Config) if f.default is not dataclasses.MISSING}


def resolve_config(config: FSDP2Config | None, args: Any) -> FSDP2Config:
    """`config` (or the defaults) with the FSDP settings of `args` or of `accelerate launch` carried in.

    When `args` asked Accelerate for FSDP, it is told not to (FSDP2Trainer shards the model itself).

    Raises:
        ValueError: for a setting that cannot carry over (FSDP1, its options, XLA), naming it and the fix.
    """
    config = _carry_parallelism(config if config is not None else FSDP2Config(), args)
    found = _read_settings(args)
    if found is None:
        return _carry_mixed_precision(config, args)
    source, raw, plugin_args = found
    _refuse_what_cannot_carry(source, raw, plugin_args)
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    carried = _fields_from_plugin(plugin)
    unknown = sorted(k for k in raw if k not in CARRIED_KEYS and k not in FSDP1_ONLY)
    if unknown:
        warn_rank0(
            "Not carried over from %s (FSDP2Config has no such setting): %s. Remove them to silence this.",
            source,
            ", ".join(unknown),
        )
    config = _apply(config, carried, source)
    _log_notes(source, plugin)
    if args is not None and getattr(args, "fsdp", None):
        # NOTE: Accelerate must not shard the model a second time (and Trainer refuses fsdp in one process); the
        # settings live in FSDP2Config now, and stay on the arguments for the next trainer built with them.
        args.__dict__[_STASH] = found
        args.fsdp, args.fsdp_plugin_args = [], None
    return _carry_mixed_precision(config, args)


def _carry_parallelism(config: FSDP2Config, args: Any) -> FSDP2Config:
    """`TrainingArguments(parallelism_config=ParallelismConfig(...))`: data-parallel replicas become HSDP replicas;
    tensor parallelism is refused, context and sequence parallelism refused naming `sequence_parallel_size`.

    Raises:
        ValueError: for tp_size, cp_size or sp_size above 1, or dp sizes that disagree with the config or the world.
    """
    if args is None:
        return config
    parallelism = args.__dict__.get(_PARALLELISM_STASH) or getattr(args, "parallelism_config", None)
    if parallelism is None:
        return config
    tensor = getattr(parallelism, "tp_size", 1) or 1
    if tensor > 1:
        raise ValueError(
            f"TrainingArguments(parallelism_config=ParallelismConfig(tp_size={tensor})): hf_fsdp2 shards parameters "
            "with FSDP2 and has no tensor parallelism. Remove tp_size; for long rows use "
            "FSDP2Config(sequence_parallel_size=N)."
        )
    rows = {name: getattr(parallelism, name, 1) or 1 for name in ("cp_size", "sp_size")}
    asked = [f"{name}={size}" for name, size in rows.items() if size > 1]
    if asked:
        # NOTE: refused rather than carried: Accelerate's groups share one batch (the global batch shrinks by N) and
        # its context parallelism is causal-only across packed documents; ours keeps the global batch and is exact.
        raise ValueError(
            f"TrainingArguments(parallelism_config=ParallelismConfig({', '.join(asked)})): hf_fsdp2's sequence "
            f"parallelism is FSDP2Config(sequence_parallel_size={max(rows.values())}) — pass that and remove "
            f"{' and '.join(name for name, size in rows.items() if size > 1)}. Unlike Accelerate's, it keeps the "
            "global batch (per_device_train_batch_size x world_size x accumulation) and keeps packed documents apart."
        )
    replicas = getattr(parallelism, "dp_replicate_size", 1) or 1
    shards = getattr(parallelism, "dp_shard_size", 1) or 1
    if replicas > 1 and config.hsdp_replicate_size not in (1, replicas):
        raise ValueError(
            f"parallelism_config dp_replicate_size={replicas} disagrees with FSDP2Config(hsdp_replicate_size="
            f"{config.hsdp_replicate_size}); give one of them."
        )
    replicas = replicas if replicas > 1 else config.hsdp_replicate_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if shards > 1 and replicas * shards != world:
        raise ValueError(
            f"parallelism_config dp_shard_size={shards} x {replicas} replica(s) is not the {world} ranks launched; "
            "hf_fsdp2 shards over world_size / hsdp_replicate_size ranks: drop dp_shard_size."
        )
    # NOTE: Accelerate must not build a mesh of its own; the replicas live in FSDP2Config now (and the setting
    # stays on the arguments for the next trainer built with them).
    args.__dict__[_PARALLELISM_STASH], args.parallelism_config = parallelism, None
    if replicas != config.hsdp_replicate_size:
        log_rank0("From parallelism_config: dp_replicate_size=%d -> hsdp_replicate_size.", replicas)
    return dataclasses.replace(config, hsdp_replicate_size=replicas)


def _read_settings(args: Any) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """(where from, raw keys, the plugin's arguments) of TrainingArguments' or `accelerate launch`'s FSDP."""
    if args is not None and _STASH in args.__dict__:
        return args.__dict__[_STASH]
    if args is not None and getattr(args, "fsdp", None):
        raw = dict(getattr(args, "fsdp_config", None) or {})
        plugin_args = dict(getattr(args, "fsdp_plugin_args", None) or {})
        return "TrainingArguments(fsdp=..., fsdp_config=...)", raw, plugin_args
    # NOTE: `accelerate launch` always exports FSDP_VERSION; ACCELERATE_USE_FSDP alone was set by an Accelerator
    # made earlier in this process (a plain Trainer with FSDP), which carries no launch settings.
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and "FSDP_VERSION" in os.environ:
        raw = {k[len("FSDP_") :].lower(): v for k, v in os.environ.items() if k.startswith("FSDP_")}
        return "accelerate launch --use_fsdp", raw, {}  # the plugin reads the FSDP_* variables itself
    return None


def _refuse_what_cannot_carry(source: str, raw: dict[str, Any], plugin_args: dict[str, Any]) -> None:
    """FSDP1, its options and XLA have no FSDP2 meaning: name each with its fix instead of ignoring it."""
    if str(raw.get("xla", "false")).lower() in ("true", "1"):
        raise ValueError(
            f"{source} asks for XLA FSDP (xla=True), which is not FSDP2; hf_fsdp2 shards with torch's fully_shard "
            "on CUDA or CPU. Remove xla, or use Trainer with Accelerate's XLA FSDP."
        )
    version = int(plugin_args.get("fsdp_version") or raw.get("version") or 1)
    if version != 2:
        fix = "fsdp_config={'version': 2, ...}" if source.startswith("TrainingArguments") else "--fsdp_version 2"
        raise ValueError(
            f"{source} asks for FSDP version {version} (FSDP1); hf_fsdp2 shards with FSDP2 (fully_shard). "
            f"Use {fix}, and replace FSDP1-only options as the error for each will say."
        )
    launched = source.startswith("accelerate launch")
    given = [k for k in FSDP1_ONLY if k in raw and not _is_unset(k, raw[k], launched)]
    if given:
        raise ValueError(
            f"{source} sets FSDP1-only options that have no FSDP2 meaning: "
            + "; ".join(f"{k}={raw[k]!r} ({FSDP1_ONLY[k]})" for k in given)
            + "."
        )


def _is_unset(key: str, value: Any, launched: bool) -> bool:
    """An FSDP1 option that asks for nothing: off, or (from `accelerate launch`, which exports every option
    whether given or not) at the launcher's default, which Accelerate itself ignores under FSDP2."""
    text = str(value).strip().lower()
    if key == "use_orig_params":
        return text in ("", "none", "true")
    if text in ("", "none", "no_prefetch", "false"):
        return True
    return launched and (key, text) in {("sharding_strategy", "full_shard"), ("sharding_strategy", "1"),
                                        ("sync_module_states", "true")}  # fmt: skip


def _fields_from_plugin(plugin: Any) -> dict[str, Any]:
    """The FSDP2Config fields Accelerate's parsed plugin stands for."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = plugin.auto_wrap_policy
    name = getattr(policy, "__name__", None) or getattr(getattr(policy, "func", None), "__name__", None)
    carried: dict[str, Any] = {"auto_wrap_policy": _WRAP_POLICIES.get(name, "no_wrap") if policy else "no_wrap"}
    if plugin.transformer_cls_names_to_wrap:
        carried["transformer_layer_cls_to_wrap"] = list(plugin.transformer_cls_names_to_wrap)
    if plugin.min_num_params:
        carried["min_num_params"] = int(plugin.min_num_params)
    carried["reshard_after_forward"] = str(bool(plugin.reshard_after_forward)).lower()
    carried["cpu_offload"] = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    carried["fsdp_activation_checkpointing"] = bool(plugin.activation_checkpointing)
    return carried


def _apply(config: FSDP2Config, carried: dict[str, Any], source: str) -> FSDP2Config:
    """Carried values fill the fields left at their defaults; a field the user set wins (said once)."""
    taken, kept = {}, []
    for name, value in carried.items():
        current = getattr(config, name)
        if current == value:
            continue
        if current != _DEFAULTS.get(name):
            kept.append(f"{name}={current!r} (carried: {value!r})")
        else:
            taken[name] = value
    if kept:
        log_rank0("FSDP2Config wins over %s for: %s.", source, "; ".join(kept))
    settings = {f"{name}={value!r}" for name, value in carried.items()}
    log_rank0("Carried over from %s into FSDP2Config: %s.", source, ", ".join(sorted(settings)))
    return dataclasses.replace(config, **taken) if taken else config


def _log_notes(source: str, plugin: Any) -> None:
    """Say what the settings without an FSDP2Config field mean here."""
    state_dict_type = str(getattr(plugin.state_dict_type, "name", plugin.state_dict_type))
    notes = ["loading is always RAM-efficient (each rank reads its own slices; cpu_ram_efficient_loading is moot)"]
    if state_dict_type == "FULL_STATE_DICT":
        notes.append(
            "state_dict_type=FULL_STATE_DICT: checkpoints are sharded (resumable on any world size) and the end of "
            "training writes the full Hugging Face folder (consolidate_on_train_end)"
        )
    else:
        notes.append(f"state_dict_type={state_dict_type}: checkpoints are sharded DCP folders in Accelerate's layout")
    log_rank0("From %s: %s.", source, "; ".join(notes))


def _carry_mixed_precision(config: FSDP2Config, args: Any) -> FSDP2Config:
    """`accelerate launch --mixed_precision bf16|fp16` (TrainingArguments.mixed_precision) means that compute dtype
    here; fp16 then trains with the gradient scaler, as TrainingArguments(fp16=True) does."""
    mixed = getattr(args, "mixed_precision", "no") if args is not None else os.environ.get("ACCELERATE_MIXED_PRECISION")
    if mixed == "fp8":
        return _carry_fp8(config)
    dtypes = {"bf16": ("bfloat16", "bf16"), "fp16": ("float16", "fp16")}
    if mixed not in dtypes or config.param_dtype is not None:
        return config
    dtype, flag = dtypes[mixed]
    if getattr(args, flag, False):
        return config  # the TrainingArguments field itself says it; the policy follows it
    log_rank0("Carried over from accelerate launch --mixed_precision %s: param_dtype=%r.", mixed, dtype)
    return dataclasses.replace(config, param_dtype=dtype)


def _carry_fp8(config: FSDP2Config) -> FSDP2Config:
    """`accelerate launch --mixed_precision fp8` asks for FP8 matmuls with bf16 around them. Accelerate is told "no"
    (sharding.py), so without this the request would vanish and the run train in full precision: here it becomes
    float8=True (torchao's float8, whichever FP8 backend Accelerate was given), which refuses a machine without FP8
    tensor cores by name."""
    param_dtype = config.param_dtype or "bfloat16"
    if config.float8 and config.param_dtype == param_dtype:
        return config
    backend = os.environ.get("ACCELERATE_FP8_BACKEND")
    log_rank0(
        "Carried over from accelerate launch --mixed_precision fp8: float8=True, param_dtype=%r (torchao's float8%s).",
        param_dtype,
        f" in place of Accelerate's {backend} backend" if backend and backend.upper() != "AO" else "",
    )
    return dataclasses.replace(config, float8=True, param_dtype=param_dtype)
