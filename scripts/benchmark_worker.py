"""One rank of one benchmark run (launched by `scripts/benchmark.py` under torchrun, or in a plain process
for consolidation): load → train with checkpoint saves → resume, measuring each phase the same way for
every system. Results go to a JSON file written by rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

from measure_load_memory import vm_kib


def _sync() -> None:
    """Wait for queued GPU work so wall-clock marks mean what they say (no-op on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gpu_peak_mib() -> float | None:
    """Peak GPU memory allocated by this process since the last reset, or None on CPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _reset_gpu_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def make_probe(baseline_kib: int, start: float, record: dict[str, Any]) -> Any:
    """A TrainerCallback that marks when training can begin (end of loading) and times every step."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
            _sync()
            record["load_s"] = time.perf_counter() - start
            _touch(model)
            record["load_peak_mib"] = (vm_kib("VmHWM") - baseline_kib) / 1024
            record["load_gpu_peak_mib"] = _gpu_peak_mib()
            _reset_gpu_peak()

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            _sync()
            self._step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            _sync()
            record["step_s"].append(time.perf_counter() - self._step_start)

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                record["losses"].append(float(logs["loss"]))

    return Probe()


def _touch(model: Any) -> None:
    """Read every local parameter once: weights left as memory-mapped views of the checkpoint file (transformers'
    native FSDP2 does this) become resident only when first used, so they count here as at the first step."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).sum()


def _timed(record: list[float], method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Trainer method so the seconds spent in it (the training loop is blocked) are recorded."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _sync()
        start = time.perf_counter()
        result = method(*args, **kwargs)
        _sync()
        record.append(time.perf_counter() - start)
        return result

    return wrapper


def folder_bytes(path: str) -> int:
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def train_worker(args: argparse.Namespace) -> None:
    """Load, train `steps` steps saving every `save_steps`, then resume from the last checkpoint."""
    import torch.distributed as dist
    from benchmark_systems import FORCED, build_trainer, random_tokens
    from torch.distributed.tensor import DTensor

    from hf_fsdp2 import close_distributed

    baseline = vm_kib("VmHWM")  # after the imports every system shares (torch, transformers, accelerate)

    data = random_tokens(args.samples, args.seq_len, args.vocab)
    record: dict[str, Any] = {"step_s": [], "losses": [], "save_s": [], "resume_s": [], "signal_check_s": []}
    start = time.perf_counter()
    trainer = build_trainer(args.system, args, data, [make_probe(baseline, start, record)], resume=False)
    trainer._save_checkpoint = _timed(record["save_s"], trainer._save_checkpoint)
    watcher = getattr(trainer, "_preemption", None)
    if watcher is not None:  # hf_fsdp2's per-step preemption check (an all-reduce of one integer)
        watcher.agreed_stop = _timed(record["signal_check_s"], watcher.agreed_stop)
    trainer.train()
    _sync()
    record["train_peak_mib"] = (vm_kib("VmHWM") - baseline) / 1024
    record["train_gpu_peak_mib"] = _gpu_peak_mib()
    record["final_loss"] = record["losses"][-1]
    params = list(trainer.model.parameters())
    record["sharded_fraction"] = sum(isinstance(p, DTensor) for p in params) / len(params)
    record["notes"] = list(dict.fromkeys(FORCED))
    checkpoint = os.path.join(args.run_dir, f"checkpoint-{args.steps}")
    del trainer
    gc.collect()

    if args.resume:
        resumed: dict[str, Any] = {"step_s": [], "losses": [], "save_s": [], "resume_s": []}
        trainer = build_trainer(
            args.system, args, data, [make_probe(baseline, time.perf_counter(), resumed)], resume=True
        )
        for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"):
            setattr(trainer, name, _timed(record["resume_s"], getattr(trainer, name)))
        trainer.train(resume_from_checkpoint=checkpoint)
        record["loss_after_resume"] = resumed["losses"][-1] if resumed["losses"] else None
        del trainer
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, record)
    if dist.get_rank() == 0:
        summary = {"ranks": rows, "checkpoint": checkpoint, "checkpoint_bytes": folder_bytes(checkpoint)}
        with open(args.result, "w") as f:
            json.dump(summary, f)
    close_distributed()


def consolidate_worker(args: argparse.Namespace) -> None:
    """Run one system's consolidation tool in this fresh process; report its time and peak RAM above imports."""
    from benchmark_systems import consolidation_tool

    run = consolidation_tool(args.system)
    baseline = vm_kib("VmHWM")
    start = time.perf_counter()
    run(args.checkpoint, args.output)
    seconds = time.perf_counter() - start
    with open(args.result, "w") as f:
        json.dump({"peak_mib": (vm_kib("VmHWM") - baseline) / 1024, "seconds": seconds}, f)
