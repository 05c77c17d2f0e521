"""What every part of the GPU check shares: the sizes, the models' folders, data, arguments and memory marks."""

from __future__ import annotations

import os
from typing import Any

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "B200": 2250e12}


BF16_REL_TOLERANCE = 0.02  # bf16 rounds to 2^-8 relative: 20 steps of two different bf16 programs stay within 2%


# fp16 keeps 10 mantissa bits (rounds to 2^-11 relative), 8 times finer than bf16's 2^-8: the bf16 tolerance over 8.
FP16_REL_TOLERANCE = BF16_REL_TOLERANCE / 8


FP32_TOLERANCE = 1e-5


# FP8 training (part fp8) against bf16 over the same steps: bf16's 2% of the largest loss. FP8 (e4m3) rounds each
# weight, activation and gradient to 2^-4 relative, but with one scale per tensor and fp32 accumulation the matmuls'
# errors average out; torchao and torchtitan publish FP8 loss curves that overlay bf16's. Our CPU test of the same path
# (torchao's emulated FP8, tests/test_float8.py) measured 1.5e-3 on losses of 5.5 (0.03%).
FP8_REL_TOLERANCE = BF16_REL_TOLERANCE


def sizes(dry_run: bool) -> dict[str, dict[str, Any]]:
    """The models and row lengths of each part: real ones on a GPU, tiny ones for the CPU rehearsal."""
    if dry_run:
        small = dict(hidden=64, layers=2, heads=4, kv=2, inter=128, vocab=512, tied=True, dtype="float32")
        big = dict(hidden=64, layers=2, heads=4, kv=2, inter=256, vocab=1024, tied=True, dtype="bfloat16")
        # FP8's tiny model: its MLP projections (64 -> 1088) are the only layers torchao's filter converts.
        m3b = dict(hidden=64, layers=2, heads=4, kv=2, inter=1088, vocab=1024, tied=True, dtype="bfloat16")
        run = dict(batch=2, seq=64, long=(128, 256), chunk=64, steps=4)
        return {"m100": small, "m1b": big, "m3b": m3b, "run": run}
    small = dict(hidden=768, layers=12, heads=12, kv=4, inter=2048, vocab=16000, tied=True, dtype="float32")
    big = dict(hidden=2048, layers=16, heads=32, kv=8, inter=8192, vocab=128256, tied=True, dtype="bfloat16")
    # Llama-3.2-3B's shape (part fp8): 3.2B parameters.
    m3b = dict(hidden=3072, layers=28, heads=24, kv=8, inter=8192, vocab=128256, tied=True, dtype="bfloat16")
    run = dict(batch=4, seq=2048, long=(16384, 32768), chunk=4096, steps=10)
    return {"m100": small, "m1b": big, "m3b": m3b, "run": run}


def dry_run() -> bool:
    return os.environ.get("GPU_CHECK_DRY_RUN") == "1"


def model_path(name: str) -> str:
    return os.path.join(os.environ["GPU_CHECK_WORKDIR"], f"model-{name}")


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def free_memory() -> None:
    """Drop what the last run left, so the next run's peak is its own."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_mark() -> float:
    """MiB at the high-water mark since the last reset: allocated GPU memory, or the resident set on the CPU."""
    from peak_memory import peak_bytes

    return peak_bytes() / 2**20


def reset_memory_mark() -> float:
    """Reset the high-water mark; the MiB a peak is counted above (0 on a GPU: its peaks are absolute, as the
    planner's are; the resident set now on the CPU, where the process's own libraries are not the run's)."""
    import torch
    from peak_memory import reset_peak

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        reset_peak()
        return 0.0
    return reset_peak() / 2**20


def dataset(spec: dict, vocab: int) -> Any:
    """Token rows for a run: random, or (parity) 8 random rows repeated, which a model learns within 20 steps."""
    import torch
    from datasets import Dataset

    rows = spec["steps"] * spec["batch"]
    generator = torch.Generator().manual_seed(0)
    distinct = 8 if spec.get("data") == "pattern" else rows
    ids = torch.randint(0, vocab, (distinct, spec["seq"]), generator=generator).tolist()
    ids = [ids[i % distinct] for i in range(rows)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_arguments(spec: dict, out: str, **extra: Any) -> Any:
    """One schedule for every system: constant LR, a loss every step, no saves unless asked."""
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=spec["batch"], max_steps=spec["steps"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, bf16=spec.get("bf16", False), fp16=spec.get("fp16", False),
        use_liger_kernel=spec.get("liger", False), use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True, seed=0, **extra,
    )  # fmt: skip
