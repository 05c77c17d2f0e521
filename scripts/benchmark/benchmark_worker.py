"""One rank of one benchmark run (its ranks started by `scripts/benchmark/benchmark.py` as torchrun would, or a plain
process for consolidation): load → train with checkpoint saves → resume, measuring each phase the same way for
every system. Results go to a JSON file written by rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common")]
from peak_memory import vm_kib  # noqa: E402

START_DIR_ENV = "HF_FSDP2_BENCHMARK_START_DIR"  # set by the launcher: where the ranks meet before the clock starts


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


_GATHERED = {"bytes": 0}


def count_all_gathers() -> dict[str, int]:
    """Count the bytes every all-gather produces on this rank (FSDP2's parameter gathers, for every system).

    Wraps the torch.distributed entry points FSDP2 calls (`all_gather_into_tensor`; `all_gather_single` from
    torch 2.13), looked up at call time: measurement only, the collectives run unchanged.
    """
    import torch.distributed as dist

    counter = _GATHERED
    for name in ("all_gather_into_tensor", "all_gather_single"):
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_counted", False):
            continue

        def counted(output: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counter["bytes"] += output.numel() * output.element_size()
            return _original(output, *args, **kwargs)

        counted._counted = True  # type: ignore[attr-defined]
        setattr(dist, name, counted)
    return counter


def parameter_bytes(model: Any) -> dict[str, int]:
    """This rank's parameter bytes (NF4 weights by their 4-bit inner tensors), the frozen base's part, its element
    count, and the largest local tensor (the slice a rank reads at once while loading)."""
    from hf_fsdp2.adapters.nf4 import is_nf4, stored_bytes

    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    local = [getattr(p, "_local_tensor", p) for p in params]
    return {
        "param_bytes": sum(stored_bytes(p) for p in params),
        "base_bytes": sum(stored_bytes(p) for p in frozen),
        "base_numel": sum(getattr(p, "_local_tensor", p).numel() for p in frozen),
        "nf4_bytes": sum(stored_bytes(p) for p in frozen if is_nf4(p)),
        "nf4_numel": sum(getattr(p, "_local_tensor", p).numel() for p in frozen if is_nf4(p)),
        "largest_slice_bytes": max(t.numel() * t.element_size() for t in local if not is_nf4(t)),
    }


def file_view_bytes(model: Any) -> int | None:
    """This rank's parameter bytes that are still views of a file mapping (the checkpoint mapped privately): such
    weights take whatever is written into the file in place later, until a step writes them. None off Linux."""
    if not os.path.exists("/proc/self/maps"):
        return None
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                spans.append((low, high))
    total = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        address = local.data_ptr()
        if local.device.type == "cpu" and any(low <= address < high for low, high in spans):
            total += local.numel() * local.element_size()
    return total


def start_together() -> None:
    """Wait until every rank of this run is here (its imports done), so the load clock starts at once on all ranks.

    NOTE: without it a rank that finished importing early waited inside the first collective of loading for one
    still importing: up to 1.5 s of one rank's import time counted as another's load, for every system alike.
    A file per rank in a folder the launcher made for this run (no process group exists yet: each system
    creates its own while loading).
    """
    directory = os.environ.get(START_DIR_ENV)
    if directory is None:
        return
    open(os.path.join(directory, os.environ["RANK"]), "w").close()
    while len(os.listdir(directory)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.001)


def make_probe(baseline_kib: int, start: float, record: dict[str, Any]) -> Any:
    """A TrainerCallback that marks when training can begin (end of loading), times every step and counts the
    bytes all-gathered in it."""
    from transformers import TrainerCallback

    gathered = count_all_gathers()

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
            # The touch is inside the load time: weights left memory-mapped (transformers' native FSDP2) are
            # only read from the file there; else the first step, left out as warm-up, would pay for it.
            _touch(model)
            _sync()
            record["load_s"] = time.perf_counter() - start
            record["file_view_bytes"] = file_view_bytes(model)
            record["load_peak_mib"] = (vm_kib("VmHWM") - baseline_kib) / 1024
            record["load_gpu_peak_mib"] = _gpu_peak_mib()
            record.update(parameter_bytes(model))
            _reset_gpu_peak()

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            _sync()
            gathered["bytes"] = 0
            self._step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            _sync()
            record["step_s"].append(time.perf_counter() - self._step_start)
            record["gathered_bytes"].append(gathered["bytes"])

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                record["losses"].append(float(logs["loss"]))

    return Probe()


def _touch(model: Any) -> None:
    """Read every local parameter once: weights left as memory-mapped views of the checkpoint file (transformers'
    native FSDP2 does this) become resident only when first used, so their reading and memory count in the load
    as they would at the first step."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            getattr(local, "quantized_data", local).sum()  # an NF4 weight: its 4-bit codes


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


def _billed_to_last_save(record: list[float], trainer: Any) -> Callable[[], None]:
    """hf_fsdp2's wait for an async save's host copy (right before the next optimizer step), its seconds added to
    that save's blocked time: the save call returns before the copy ends."""
    wait = trainer._wait_for_staging

    def wrapper() -> None:
        if not trainer._unstaged or not record:
            return wait()
        start = time.perf_counter()
        wait()
        record[-1] += time.perf_counter() - start

    return wrapper


def folder_bytes(path: str) -> int:
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def train_worker(args: argparse.Namespace) -> None:
    """Load, train `steps` steps saving every `save_steps`, then resume from the last checkpoint."""
    import torch.distributed as dist
    from benchmark_systems import ADAPTERS, FORCED, build_trainer, random_tokens
    from torch.distributed.tensor import DTensor

    from hf_fsdp2 import close_distributed
    from hf_fsdp2.distributed import init_distributed

    baseline = vm_kib("VmHWM")  # after the imports every system shares (torch, transformers, accelerate)

    data = random_tokens(args.samples, args.seq_len, args.vocab)
    record: dict[str, Any] = {"step_s": [], "losses": [], "save_s": [], "resume_s": [], "signal_check_s": []}
    record["gathered_bytes"] = []
    if args.system in ADAPTERS:  # the process's own memory, apart from the model's (the QLoRA load target)
        init_distributed()
        dist.barrier()
        if args.system == "hf_fsdp2_qlora":  # torchao's first NF4 use costs ~16 MiB once (lazy torch._dynamo setup)
            import torch
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

            to_nf4(torch.zeros(256, 256))
        record["runtime_peak_mib"] = (vm_kib("VmHWM") - baseline) / 1024
    start_together()
    start = time.perf_counter()
    trainer = build_trainer(args.system, args, data, [make_probe(baseline, start, record)], resume=False)
    trainer._save_checkpoint = _timed(record["save_s"], trainer._save_checkpoint)
    if hasattr(trainer, "_wait_for_staging"):
        trainer._wait_for_staging = _billed_to_last_save(record["save_s"], trainer)
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
        resumed: dict[str, Any] = {"step_s": [], "losses": [], "save_s": [], "resume_s": [], "gathered_bytes": []}
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
