"""Export a live sharded model to a Hugging Face folder two ways, side by side: time and peak host RAM.

    python scripts/measure/compare_export_writers.py [--nproc 2] [--layers 12] [--repeats 2] [--json out.json]

- `hf_fsdp2`: `FSDP2Trainer.save_model` — every tensor is gathered in turn and rank 0 streams it into
  safetensors files (one tensor in flight; the shard plan is huggingface_hub's).
- `dcp_hf_writer`: torch DCP's `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`
  — every rank writes its own shards, then rank 0 consolidates them into full safetensors files.

Each system runs in its own `torchrun` launch (CPU, gloo) on the ~110M-parameter Llama of
measure_load_memory.py. Per rank it records the wall time of the export and the peak resident memory
(VmHWM, reset right before the export via /proc/self/clear_refs) above the resident memory at that point.
Both outputs are reloaded with `from_pretrained` and compared tensor by tensor.
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
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from llama_model import build_model  # noqa: E402
from peak_memory import vm_kib  # noqa: E402

MIB = 2**20
SYSTEMS = ("hf_fsdp2", "dcp_hf_writer")


def reset_peak() -> None:
    """Make VmHWM start again from the current resident set (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def export_with_dcp(model, output_dir: str) -> None:
    """torch's own distributed Hugging Face save, consolidated into full files by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    writer = HuggingFaceStorageWriter(output_dir, save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)


def worker(args: argparse.Namespace) -> None:
    """One rank: load with FSDP2Trainer, then time one export and measure its peak."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    from hf_fsdp2 import FSDP2Config, FSDP2Trainer

    targs = TrainingArguments(output_dir=os.path.join(args.workdir, "run"), report_to=[], use_cpu=True)
    trainer = FSDP2Trainer(args.model_path, targs, fsdp2_config=FSDP2Config(consolidate_on_train_end=False))
    dist.barrier()
    reset_peak()
    before = vm_kib("VmRSS")
    start = time.perf_counter()
    if args.system == "hf_fsdp2":
        trainer.save_model(args.output)
    else:
        export_with_dcp(trainer.model, args.output)
    dist.barrier()
    row = {"rank": dist.get_rank(), "seconds": time.perf_counter() - start}
    row["peak_mib"] = (vm_kib("VmHWM") - before) / 1024
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(rows, f)


def launch(args: argparse.Namespace, system: str, model_path: str, output: str, result: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    command += [os.path.abspath(__file__), "--worker", "--system", system, "--model-path", model_path]
    command += ["--output", output, "--result", result, "--workdir", args.workdir]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(result) as f:
        return json.load(f)


def max_difference(a: str, b: str) -> float:
    """Largest elementwise difference between two exported folders' weights, loaded by from_pretrained."""
    from transformers import AutoModelForCausalLM

    first, second = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (a, b))
    assert first.keys() == second.keys(), sorted(set(first) ^ set(second))
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12, help="12 layers = 110M parameters")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_export")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--system", "--model-path", "--output", "--result"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    model_path = os.path.join(args.workdir, f"llama-{args.layers}l")
    model_bytes = build_model(model_path, args.layers)
    runs: dict[str, list[list[dict]]] = {s: [] for s in SYSTEMS}
    for repeat in range(args.repeats):
        for system in SYSTEMS if repeat % 2 == 0 else reversed(SYSTEMS):
            output = os.path.join(args.workdir, f"{system}-{repeat}")
            subprocess.run(["rm", "-rf", output], check=True)
            result = os.path.join(args.workdir, f"{system}-{repeat}.json")
            runs[system].append(launch(args, system, model_path, output, result))
            if system == "dcp_hf_writer":  # DCP writes weights only; from_pretrained also needs the config
                shutil.copy(os.path.join(model_path, "config.json"), output)
    difference = max_difference(*(os.path.join(args.workdir, f"{s}-0") for s in SYSTEMS))
    print(f"model: {model_bytes / MIB:.0f} MiB, {args.nproc} ranks, {args.repeats} runs each (median, min-max)")
    print("| system | export time, slowest rank (s) | peak RAM, worst rank (MiB) | × model |")
    print("|---|---:|---:|---:|")
    table = {}
    for system, repeats in runs.items():
        times = [max(r["seconds"] for r in rows) for rows in repeats]
        peaks = [max(r["peak_mib"] for r in rows) for rows in repeats]
        table[system] = {"seconds": times, "peak_mib": peaks}
        peak = statistics.median(peaks)
        print(
            f"| {system} | {statistics.median(times):.2f} ({min(times):.2f}–{max(times):.2f}) | "
            f"{peak:.0f} ({min(peaks):.0f}–{max(peaks):.0f}) | {peak * MIB / model_bytes:.2f}× |"
        )
    print(f"largest weight difference between the two exports: {difference}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_bytes": model_bytes, "runs": table, "max_difference": difference}, f, indent=2)


if __name__ == "__main__":
    main()
