"""What each `TrainingArguments` field does under FSDP2Trainer: honoured, refused, or no effect on training.

Every field of the pinned transformers has a verdict here (tests/test_argument_verdicts.py enumerates them), so a
field a new transformers adds fails that test until someone decides. Refused fields fail at construction, by name,
when set to anything but their default. It reads arguments only; the trainer calls `refuse_arguments`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Verdict = Literal["honoured", "refused", "no effect"]

# Honoured: Trainer's own behaviour, unchanged by sharding (the test that shows it, where one does).
_HONOURED = {
    "per_device_train_batch_size": "each rank's batch (tests/test_parity.py)",
    "num_train_epochs": "Trainer's loop",
    "auto_find_batch_size": (
        "an out-of-memory error on any rank makes every rank retry with the same smaller batch, where every rank can "
        "step back together (tests/test_switches.py; the limits: docs/troubleshooting.md); refused on a torch without "
        "FSDPModule.reset_iter_state (2.11)"
    ),
    "max_steps": "Trainer's loop (tests/test_parity.py)",
    "learning_rate": "the optimizer over the shards (hf_fsdp2.Muon: both its parts; tests/test_muon.py)",
    "lr_scheduler_type": "Trainer's scheduler",
    "lr_scheduler_kwargs": "Trainer's scheduler",
    "warmup_steps": "Trainer's scheduler",
    "optim": "Trainer's optimizer over the shards (elementwise updates: see the README on optimizers)",
    "optim_args": "with `optim`; hf_fsdp2.Muon's own knobs (momentum, ns_steps, ...) under optimizer_cls_and_kwargs",
    "optim_target_modules": "with `optim` (GaLore, APOLLO)",
    "weight_decay": "elementwise; norms and biases undecayed, as Trainer splits them (hf_fsdp2.Muon too)",
    "adam_beta1": "elementwise (hf_fsdp2.Muon: its AdamW part)",
    "adam_beta2": "elementwise (hf_fsdp2.Muon: its AdamW part)",
    "adam_epsilon": "elementwise (hf_fsdp2.Muon: its AdamW part)",
    "gradient_accumulation_steps": "tests/test_parity.py (reduced every micro-step unless defer_gradient_sync)",
    "average_tokens_across_devices": "tests/test_parity.py; not applied to losses that ignore num_items_in_batch",
    "max_grad_norm": "global norm over the DTensor gradients (tests/test_parity.py)",
    "label_smoothing_factor": "Trainer's LabelSmoother on each rank's rows (tests/test_argument_verdicts.py)",
    "bf16": "FSDP2's MixedPrecisionPolicy (fp32 masters, bf16 compute)",
    "fp16": (
        "FSDP2's MixedPrecisionPolicy (fp32 masters, fp16 compute, fp32 reduction) and a gradient scaler whose "
        "inf/NaN check covers every rank's shards, saved in checkpoints (tests/test_switches.py)"
    ),
    "bf16_full_eval": (
        "evaluation computes in bf16 through the units' compute dtype; the fp32 masters are never cast (also during "
        "train(), where plain Trainer keeps the training dtype; tests/test_switches.py)"
    ),
    "fp16_full_eval": "as bf16_full_eval, in fp16 (tests/test_switches.py)",
    "tf32": "a global torch setting",
    "use_liger_kernel": (
        "on CUDA: Trainer applies Liger to the sharded model and its fused loss runs in the root unit's forward, where "
        "the head is gathered (sharding/liger.py; refused without a CUDA device, with a PEFT-wrapped head, a head in "
        "a unit of its own, or loss_chunk_size). Untested here: no GPU run yet"
    ),
    "liger_kernel_config": "with `use_liger_kernel`",
    "activation_checkpointing": "Trainer's; refused together with FSDP2Config(fsdp_activation_checkpointing=True)",
    "activation_checkpointing_kwargs": "with `activation_checkpointing`",
    "gradient_checkpointing": "the model's own, on the skeleton (tests/test_dropin.py)",
    "gradient_checkpointing_kwargs": "with `gradient_checkpointing`",
    "torch_compile": "tests/test_dropin.py torch_compile",
    "torch_compile_backend": "with `torch_compile`",
    "torch_compile_mode": "with `torch_compile`",
    "use_cache": "set on the model config by Trainer",
    "neftune_noise_alpha": "Trainer's hook on the input embeddings (tests/test_argument_verdicts.py)",
    "save_only_model": (
        "checkpoints without optimizer and scheduler (tests/test_argument_verdicts.py); resuming from one is refused "
        "by name, where Trainer would start a fresh optimizer without a word"
    ),
    "save_strategy": "sharded DCP checkpoints",
    "save_steps": "sharded DCP checkpoints",
    "save_total_limit": "Trainer's rotation (tests/test_checkpoint.py)",
    "load_best_model_at_end": "the best DCP checkpoint reloaded (tests/test_dropin.py)",
    "metric_for_best_model": "with `load_best_model_at_end`",
    "greater_is_better": "with `load_best_model_at_end`",
    "ignore_data_skip": "Trainer's resume",
    "restore_callback_states_from_checkpoint": "trainer_state.json's callback states (tests/test_argument_verdicts.py)",
    "full_determinism": "Trainer's",
    "seed": "the skeleton is built right after seeding, as one process loads it",
    "data_seed": "Trainer's sampler",
    "use_cpu": "set by hf_fsdp2 on a machine without accelerators",
    "accelerator_config": "Accelerate's data loading, as under DDP",
    "dataloader_drop_last": "Trainer's data loader",
    "remove_unused_columns": "Trainer's data loader",
    "label_names": "Trainer's",
    "train_sampling_strategy": "Trainer's sampler, e.g. group_by_length (tests/test_argument_verdicts.py)",
    "length_column_name": "with train_sampling_strategy='group_by_length'",
    "fsdp": "carried into FSDP2Config (from_accelerate)",
    "fsdp_config": "carried into FSDP2Config (from_accelerate)",
}

# Refused: what goes wrong when sharded, and what to do instead.
_REFUSED = {
    "deepspeed": "DeepSpeed and FSDP2 both shard the model. Remove it",
    "parallelism_config": (
        "Accelerate's tensor/context parallelism would shard the model a second way. Use FSDP2Config "
        "(hsdp_replicate_size, sequence_parallel_size)"
    ),
    "enable_jit_checkpoint": (
        "Trainer's checkpoint on SIGTERM is FSDP2Config(checkpoint_on_signals=...) here, which every rank agrees on"
    ),
}

# No effect on training: what the field changes instead.
_NO_EFFECT = {
    **dict.fromkeys(("output_dir", "run_name", "project", "do_train", "do_eval", "do_predict"), "names and flags"),
    **dict.fromkeys(("resume_from_checkpoint", "local_rank"), "read by scripts or from torchrun, not by Trainer"),
    **dict.fromkeys(
        (
            "logging_strategy",
            "logging_steps",
            "logging_first_step",
            "log_on_each_node",
            "logging_nan_inf_filter",
            "log_level",
            "log_level_replica",
            "disable_tqdm",
            "report_to",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
            "skip_memory_metrics",
            "debug",
        ),
        "logging and reporting",
    ),
    "include_num_input_tokens_seen": "a logged count, gathered over ranks (tests/test_argument_verdicts.py)",
    "torch_empty_cache_steps": "frees cached accelerator memory (tests/test_argument_verdicts.py)",
    **dict.fromkeys(
        (
            "eval_strategy",
            "eval_steps",
            "eval_delay",
            "per_device_eval_batch_size",
            "prediction_loss_only",
            "eval_on_start",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "eval_accumulation_steps",
            "include_for_metrics",
            "batch_eval_metrics",
        ),
        "evaluation only",
    ),
    "save_on_each_node": "where rank-local files go; every rank writes its DCP part anyway",
    **dict.fromkeys(
        (
            "push_to_hub",
            "hub_token",
            "hub_private_repo",
            "hub_model_id",
            "hub_strategy",
            "hub_always_push",
            "hub_revision",
        ),
        "uploads",
    ),
    **dict.fromkeys(
        (
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataloader_multiprocessing_context",
            "dataloader_in_order",
        ),
        "how batches are loaded, not which",
    ),
    **dict.fromkeys(
        ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph"),
        "DDP's; the sharded model is not wrapped in DDP",
    ),
    **dict.fromkeys(("ddp_backend", "ddp_timeout"), "hf_fsdp2 starts the process group (nccl on CUDA, gloo on CPU)"),
}

VERDICTS: dict[str, tuple[Verdict, str]] = {
    **{name: ("honoured", why) for name, why in _HONOURED.items()},
    **{name: ("refused", why) for name, why in _REFUSED.items()},
    **{name: ("no effect", why) for name, why in _NO_EFFECT.items()},
}


def refuse_arguments(args: Any) -> None:
    """Refuse, by name, every refused field set to anything but its class's default.

    Raises:
        ValueError: naming each such field, why sharding cannot honour it, and what to do.
    """
    defaults = {f.name: _default(f) for f in dataclasses.fields(args)}
    problems = [
        f"{name}={getattr(args, name)!r}: {_REFUSED[name]}."
        for name in _REFUSED
        if name in defaults and getattr(args, name) != defaults[name]
    ]
    if problems:
        raise ValueError(f"{type(args).__name__} settings FSDP2Trainer cannot honour: " + " ".join(problems))


def _default(field: dataclasses.Field) -> Any:
    """A dataclass field's default value."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
