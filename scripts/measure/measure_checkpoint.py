"""Checkpoint costs on a ~100M-parameter model: time the training loop is blocked per save (sync vs
async_save, and LoRA's adapter-only checkpoints), bytes on disk against the model, peak RAM per rank while
training, and consolidation's peak memory and time against `accelerate merge-weights`.

Usage (CPU, 2 ranks):
    python scripts/measure/measure_checkpoint.py [--nproc 2] [--saves 3] [--json out.json]

Peak memory is VmHWM above the VmHWM right after imports, in a fresh process per tool.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common")]
from benchmark_worker import consolidate_worker as timed_consolidation  # noqa: E402
from benchmark_worker import folder_bytes  # noqa: E402
from llama_model import build_model  # noqa: E402
from peak_memory import MIB, vm_kib  # noqa: E402


def train_worker(args: argparse.Namespace) -> None:
    """One rank: train `saves` steps saving after each; record how long each save blocked the loop."""
    baseline = vm_kib("VmHWM")
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_fsdp2 import FSDP2Config, FSDP2Trainer, close_distributed

    ids = torch.randint(0, 16000, (64, 64), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    targs = TrainingArguments(
        output_dir=args.run_dir,
        per_device_train_batch_size=1,
        max_steps=args.saves,
        save_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
    )
    config = FSDP2Config(async_save=args.mode == "async", consolidate_on_train_end=False)
    model = args.model_path
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model

        from hf_fsdp2 import from_pretrained

        lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = get_peft_model(from_pretrained(model), lora)
    trainer = FSDP2Trainer(model, targs, fsdp2_config=config, train_dataset=data)
    blocked: list[float] = []
    original = trainer._save_checkpoint

    def timed(model, trial):
        start = time.perf_counter()
        original(model, trial)
        blocked.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed
    wait_for_staging = trainer._wait_for_staging

    def timed_wait() -> None:  # an async save's host copy, waited for before the next optimizer step: still blocked
        start = time.perf_counter()
        pending = bool(trainer._unstaged)
        wait_for_staging()
        if pending and blocked:
            blocked[-1] += time.perf_counter() - start

    trainer._wait_for_staging = timed_wait
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (vm_kib("VmHWM") - baseline) / 1024)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"blocked_s": blocked, "train_s": total, "peak_mib_per_rank": peaks}, f)
    close_distributed()


def consolidate_worker(args: argparse.Namespace) -> None:
    """Run one consolidation tool in a fresh process (the benchmark's worker: time and peak above imports)."""
    system = {"hf_fsdp2": "hf_fsdp2", "accelerate": "accelerate_fsdp2"}[args.tool]
    timed_consolidation(argparse.Namespace(**{**vars(args), "system": system}))


def run_json(command: list[str], result: str) -> dict:
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    with open(result) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_memory")
    parser.add_argument("--json", default=None)
    for hidden in ("--worker", "--mode", "--model-path", "--run-dir", "--result", "--tool", "--checkpoint", "--output"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "train":
        args.saves = int(args.saves)
        return train_worker(args)
    if args.worker == "consolidate":
        return consolidate_worker(args)

    model_path = os.path.join(args.workdir, f"llama-{args.layers}l")
    model_bytes = build_model(model_path, args.layers)
    me = os.path.abspath(__file__)
    report: dict = {"model_bytes": model_bytes, "nproc": args.nproc, "saves": {}, "consolidate": {}}
    for mode in ("sync", "async", "lora"):
        run_dir = os.path.join(args.workdir, f"ckpt-{mode}")
        shutil.rmtree(run_dir, ignore_errors=True)
        result = os.path.join(args.workdir, f"save-{mode}.json")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            me,
            "--worker",
            "train",
            "--mode",
            mode,
            "--model-path",
            model_path,
            "--run-dir",
            run_dir,
            "--result",
            result,
            "--saves",
            str(args.saves),
        ]
        row = run_json(command, result)
        row["checkpoint_bytes"] = folder_bytes(os.path.join(run_dir, f"checkpoint-{args.saves}"))
        report["saves"][mode] = row
    checkpoint = os.path.join(args.workdir, "ckpt-sync", f"checkpoint-{args.saves}")
    for tool in ("hf_fsdp2", "accelerate"):
        output = os.path.join(args.workdir, f"consolidated-{tool}")
        shutil.rmtree(output, ignore_errors=True)
        result = os.path.join(args.workdir, f"consolidate-{tool}.json")
        command = [
            sys.executable,
            me,
            "--worker",
            "consolidate",
            "--tool",
            tool,
            "--checkpoint",
            checkpoint,
            "--output",
            output,
            "--result",
            result,
        ]
        report["consolidate"][tool] = run_json(command, result)

    print(f"model: {model_bytes / MIB:.0f} MiB ({model_bytes / 4 / 1e6:.0f}M fp32 parameters), {args.nproc} ranks")
    columns = ("save mode", "blocked per save, median (min–max) s", "checkpoint on disk (MiB)", "× model")
    print("| " + " | ".join(columns) + " | peak RAM per rank (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for mode, row in report["saves"].items():
        b, size = row["blocked_s"], row["checkpoint_bytes"]
        peak = max(row["peak_mib_per_rank"])
        print(
            f"| {mode} | {statistics.median(b):.2f} ({min(b):.2f}–{max(b):.2f}) | {size / MIB:.1f} | "
            f"{size / model_bytes:.3f} | {peak:.0f} |"
        )
    sync, asyn = (statistics.median(report["saves"][m]["blocked_s"]) for m in ("sync", "async"))
    print(f"async / sync blocked time: {asyn / sync:.2f}")
    print("| consolidation | peak RAM above imports (MiB) | × model size | time (s) |")
    print("|---|---:|---:|---:|")
    for tool, row in report["consolidate"].items():
        print(f"| {tool} | {row['peak_mib']:.0f} | {row['peak_mib'] * MIB / model_bytes:.2f} | {row['seconds']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
