"""Where a checkpoint save's time goes, after one training step of the benchmark's 100M Llama on 2 ranks:

  sync save, parts one after the other   dcp.save of the model, then of the optimizer
  sync save, parts at once               each part in its own thread and gloo group (what write_parts does)
  sync save, thread_count=2              one after the other, DCP's FileSystemWriter writing with 2 threads
  async staging, hf_fsdp2's HostStager   the host copy of an async save, per part, buffers cached (waited for)
  async staging, a plain copy            the same bytes copied into cached buffers, DTensors rebuilt around them

Each way runs `--repeats` times, interleaved; the table gives rank 0's seconds (median, min-max). The README's
Sync save and Async save bullets quote it.

Usage:
    python scripts/measure/measure_save_parts.py [--repeats 6] [--workdir /tmp/hf_fsdp2_save_parts]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from llama_model import build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_save_parts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def plain_copy(state: Any, cache: dict, path: tuple = ()) -> Any:
    """`state` with every tensor copied into a buffer cached under its path (a DTensor rebuilt around its copy)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: plain_copy(v, cache, (*path, k)) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_copy(v, cache, (*path, i)) for i, v in enumerate(state)]
    if not isinstance(state, torch.Tensor):
        return state
    local = state.to_local() if isinstance(state, DTensor) else state
    if path not in cache:
        cache[path] = torch.empty_like(local, device="cpu")
    cache[path].copy_(local)
    if not isinstance(state, DTensor):
        return cache[path]
    placements, mesh = state.placements, state.device_mesh
    return DTensor.from_local(cache[path], mesh, placements, run_check=False, shape=state.shape, stride=state.stride())


def worker(args: argparse.Namespace) -> None:
    """One rank: train a step, then time each way of saving or staging, interleaved."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from datasets import Dataset
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import TrainingArguments

    from hf_fsdp2 import FSDP2Config, FSDP2Trainer
    from hf_fsdp2.checkpoints.sharded import MODEL_KEY, OPTIMIZER_KEY, model_state_dict
    from hf_fsdp2.checkpoints.sharded_save import HostStager, run_at_once, storage_writer

    ids = torch.randint(0, 16000, (8, 32), generator=torch.Generator().manual_seed(0)).tolist()
    targs = TrainingArguments(
        output_dir=os.path.join(args.workdir, "run"), per_device_train_batch_size=1, max_steps=1,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = FSDP2Trainer(os.path.join(args.workdir, "model"), targs, train_dataset=data,
                           fsdp2_config=FSDP2Config(consolidate_on_train_end=False))  # fmt: skip
    trainer.train()
    model, optimizer = trainer.model, trainer.optimizer
    parts = {"model": {MODEL_KEY: model_state_dict(model)}}
    parts["optimizer"] = {OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)}
    groups = {part: dist.new_group(backend="gloo") for part in parts}
    stagers = {part: HostStager() for part in parts}
    caches: dict[str, dict] = {part: {} for part in parts}

    def folder(way: str, part: str, repeat: int) -> str:
        return os.path.join(args.workdir, "saves", f"{way}-{repeat}", part)

    def sequential(repeat: int, threads: int = 1, way: str = "sequential") -> None:
        for part, state in parts.items():
            writer = storage_writer(folder(way, part, repeat))
            writer.thread_count = threads
            dcp.save(state, storage_writer=writer, process_group=groups[part])

    def at_once(repeat: int) -> None:
        run_at_once(
            [
                functools.partial(
                    dcp.save,
                    state,
                    storage_writer=storage_writer(folder("at_once", part, repeat)),
                    process_group=groups[part],
                )  # fmt: skip
                for part, state in parts.items()
            ]
        )

    ways = {
        "sync save, parts one after the other": sequential,
        "sync save, parts at once": at_once,
        "sync save, thread_count=2": lambda r: sequential(r, 2, "threads"),
        **{f"async staging, HostStager: {p}": lambda r, p=p: stagers[p].stage(parts[p]).result() for p in parts},
        **{f"async staging, a plain copy: {p}": lambda r, p=p: plain_copy(parts[p], caches[p]) for p in parts},
    }
    for name in [n for n in ways if n.startswith("async")]:
        ways[name](-1)  # the stagers' first call allocates their buffers: not what a later save pays
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(args.repeats):
        for name, way in ways.items():
            dist.barrier()
            if dist.get_rank() == 0:
                os.sync()  # earlier saves' dirty pages are not billed to this one
            dist.barrier()
            start = time.perf_counter()
            way(repeat)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(args.workdir, "saves"), ignore_errors=True)
    if dist.get_rank() == 0:
        print("| way | seconds, median (min–max) |\n|---|---:|")
        for name, values in seconds.items():
            print(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f}) |")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.workdir, exist_ok=True)
    build_model(os.path.join(args.workdir, "model"), 12, hidden=768, vocab=16000, tied=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.abspath(__file__)]
    options = ["--worker", "--repeats", str(args.repeats), "--workdir", args.workdir]
    subprocess.run([*command, *options], env=env, check=True)


if __name__ == "__main__":
    main()
