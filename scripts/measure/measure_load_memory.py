"""Peak host RAM of each rank while FSDP2Trainer builds and loads a ~100M-parameter model.

Usage (CPU, 2 ranks; builds the model once under --workdir):
    python scripts/measure/measure_load_memory.py --nproc 2 [--route path|rank0|lora] [--json out.json]

For every rank it reports VmHWM (peak resident set) above the VmHWM measured right after imports,
against the model's size in bytes. 'path' is the default route (each rank reads its own slices of the
safetensors files); 'rank0' is the fallback (rank 0 reads the whole model and broadcasts it); 'lora' is
the default route with a peft LoRA on the skeleton (adapters initialized by replaying peft).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from llama_model import build_model  # noqa: E402
from peak_memory import MIB, vm_kib  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """One rank: measure the after-import baseline, build the trainer, report the peak above it."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_fsdp2 import FSDP2Trainer, close_distributed, from_pretrained

    baseline = vm_kib("VmHWM")
    start = time.perf_counter()
    if args.route == "rank0" and dist_rank() == 0:
        # The fallback route: rank 0 holds the whole model (what a .bin checkpoint or an object costs).
        model = AutoModelForCausalLM.from_pretrained(args.model_path)
    else:
        model = from_pretrained(args.model_path, AutoModelForCausalLM)
    if args.route == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    targs = TrainingArguments(output_dir=os.path.join(args.workdir, "run"), report_to=[], use_cpu=True)
    trainer = FSDP2Trainer(model, targs)
    seconds = time.perf_counter() - start
    peak = vm_kib("VmHWM")
    row = {"rank": dist.get_rank(), "peak_above_baseline_mib": (peak - baseline) / 1024, "load_s": seconds}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(rows, f)
    del trainer
    close_distributed()


def dist_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--route",
        choices=["path", "rank0", "lora"],
        default="path",
        help="path: each rank reads its slices; rank0: rank 0 loads and broadcasts; "
        "lora: path + peft LoRA (r=16, q/k/v/o) on the skeleton",
    )
    parser.add_argument("--layers", type=int, default=12, help="12 layers = 110M parameters")
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_memory")
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    model_path = os.path.join(args.workdir, f"llama-{args.layers}l")
    model_bytes = build_model(model_path, args.layers)
    result = os.path.join(args.workdir, f"result-{args.route}-{args.nproc}.json")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        os.path.abspath(__file__),
        "--worker",
        "--route",
        args.route,
        "--workdir",
        args.workdir,
        "--model-path",
        model_path,
        "--result",
        result,
    ]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(result) as f:
        rows = json.load(f)
    print(
        f"model: {model_bytes / MIB:.0f} MiB ({model_bytes / 4 / 1e6:.0f}M fp32 parameters), "
        f"{args.nproc} ranks, route={args.route}"
    )
    print("| rank | peak RAM above baseline (MiB) | × model size | load time (s) |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        ratio = row["peak_above_baseline_mib"] * MIB / model_bytes
        row["ratio_to_model"] = ratio
        print(f"| {row['rank']} | {row['peak_above_baseline_mib']:.0f} | {ratio:.2f} | {row['load_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model_bytes": model_bytes, "nproc": args.nproc, "route": args.route, "ranks": rows}, f, indent=2
            )


if __name__ == "__main__":
    main()
