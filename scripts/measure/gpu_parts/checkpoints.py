"""Part "checkpoints": blocked time of sync and async saves, resume and consolidation of the 1B model."""

from __future__ import annotations

import os
import shutil
import time
import traceback
from typing import Any

from gpu_parts.common import dataset, free_memory, model_path
from gpu_parts.training import hf_fsdp2_trainer


def checkpoints(spec: dict) -> dict:
    """Blocked time of sync and async saves, resume time, and consolidation, on the workdir's disk.

    Each mode writes to its own folder, keeping only its last checkpoint (1B: 15 GiB each, on a 64 GiB disk); a
    failure of one mode is recorded and the others still run.
    """
    from benchmark_worker import folder_bytes
    from transformers import AutoConfig

    steps = 2
    spec = dict(spec, steps=steps, lr=1e-5)
    data = dataset(dict(spec, steps=steps + 1), AutoConfig.from_pretrained(model_path(spec["model"])).vocab_size)
    root = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "checkpoints")
    shutil.rmtree(root, ignore_errors=True)
    record: dict[str, Any] = {"disk": disk_of(os.environ["GPU_CHECK_WORKDIR"])}
    for mode in ("sync", "async"):
        try:
            record |= save_twice(spec, data, os.path.join(root, mode), mode)
        except Exception as error:  # noqa: BLE001 - recorded; the other measurements still run
            traceback.print_exc()
            record[f"{mode}_error"] = f"{type(error).__name__}: {error}"[-1000:]
        free_memory()
        if mode == "async":
            shutil.rmtree(os.path.join(root, mode), ignore_errors=True)
    checkpoint = os.path.join(root, "sync", f"checkpoint-{steps}")
    record["checkpoint_bytes"] = folder_bytes(checkpoint)
    record |= resume_and_consolidate(spec, data, checkpoint, steps)
    shutil.rmtree(root, ignore_errors=True)
    return record


def save_twice(spec: dict, data: Any, folder: str, mode: str) -> dict:
    """Train 2 steps saving after each (the first async save also sets up its host buffers); the blocked times."""
    from benchmark_worker import _timed

    saves: list[float] = []
    trainer = hf_fsdp2_trainer(spec, data, folder, [], async_save=mode == "async")
    trainer.args.save_strategy, trainer.args.save_steps, trainer.args.save_total_limit = "steps", 1, 1
    trainer._save_checkpoint = _timed(saves, trainer._save_checkpoint)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    del trainer
    return {f"{mode}_save_blocked_s": [round(s, 3) for s in saves], f"{mode}_train_with_saves_s": round(seconds, 2)}


def resume_and_consolidate(spec: dict, data: Any, checkpoint: str, steps: int) -> dict:
    """Seconds to load a checkpoint into a fresh trainer, and to consolidate it into a Hugging Face folder."""
    from benchmark_worker import _timed, folder_bytes

    import hf_fsdp2

    resume: list[float] = []
    trainer = hf_fsdp2_trainer(dict(spec, steps=steps + 1), data, os.path.dirname(checkpoint), [])
    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"):
        setattr(trainer, name, _timed(resume, getattr(trainer, name)))
    trainer.train(resume_from_checkpoint=checkpoint)
    del trainer
    free_memory()
    output = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "consolidated")
    shutil.rmtree(output, ignore_errors=True)
    start = time.perf_counter()
    hf_fsdp2.consolidate(checkpoint, output)
    seconds = time.perf_counter() - start
    written = folder_bytes(output)
    shutil.rmtree(output, ignore_errors=True)
    return {"resume_s": round(sum(resume), 3), "consolidate_s": round(seconds, 2), "consolidated_bytes": written}


def disk_of(path: str) -> str:
    """Which filesystem the checkpoints went to (tmpfs would make the save times RAM times)."""
    best = ("", "?")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            if os.path.abspath(path).startswith(point) and len(point) > len(best[0]):
                best = (point, kind)
    return f"{best[0]} ({best[1]})"


def checkpoint_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("checkpoints", {})
    if not run:
        return []
    if "checkpoint_bytes" not in run:  # the whole run failed (a first version kept one record for every mode)
        return ["", "| checkpoints | seconds |", "|---|---:|", f"| failed | {run.get('error', '?')[:100]} |"]

    def saves(mode: str) -> str:
        if f"{mode}_error" in run:
            return "failed: " + run[f"{mode}_error"][:100]
        return ", ".join(map(str, run[f"{mode}_save_blocked_s"]))

    return [
        "",
        f"| checkpoints ({run['checkpoint_bytes'] / 2**30:.1f} GiB, on {run['disk']}) | seconds |",
        "|---|---:|",
        f"| sync save, blocked (1st, 2nd) | {saves('sync')} |",
        f"| async save, blocked (1st, 2nd) | {saves('async')} |",
        f"| resume | {run['resume_s']} |",
        f"| consolidate | {run['consolidate_s']} |",
    ]
