"""What a loaded model keeps of its checkpoint file: the safety step behind hf_fsdp2's load time.

hf_fsdp2 copies each rank's rows into its shards. transformers' native FSDP2 (`from_pretrained(...,
distributed_config=...)`) leaves every weight a private memory map of the file until a step writes it, which is why
its load is faster (README, Performance: "Load time"). A file rewritten in place after loading (`cp` or `rsync
--inplace` onto it, a download resumed into it) then reaches every weight no step has written yet: a frozen base,
an unused branch, an evaluation-only run. Two rewrites, each on a fresh copy of the checkpoint, 2 ranks per run:

  zero      rank 0 overwrites the file's tensor bytes with zeros (same size, header kept), then every rank counts
            the bytes of its local weights that differ from a copy taken before
  truncate  rank 0 cuts the file to half its size, then every rank reads all its weights; a read past the new end
            of a mapped file kills the process (SIGBUS)

Usage:
    python scripts/measure/measure_file_rewrite.py [--layers 4] [--hidden 256] [--modes zero,truncate] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from llama_model import build_model  # noqa: E402

SYSTEMS = ("hf_fsdp2", "transformers_fsdp2")
MODES = ("zero", "truncate")
CHUNK = 16 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load(system: str, path: str):  # noqa: ANN201
    """The sharded model as each system loads it (the process group starts here)."""
    import torch.distributed as dist

    if system == "hf_fsdp2":
        import hf_fsdp2

        return hf_fsdp2.prepare_model(hf_fsdp2.from_pretrained(path), hf_fsdp2.FSDP2Config())
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
    if not dist.is_initialized():
        raise RuntimeError("from_pretrained(distributed_config=...) did not start the process group.")
    return model


def rewrite(path: str, mode: str) -> None:
    """Rewrite the safetensors file in place: its tensor bytes zeroed, or the file cut to half its size."""
    from hf_fsdp2.loading.safetensors_reader import read_header

    if mode == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
        return
    _, data_start = read_header(path)
    remaining = os.path.getsize(path) - data_start
    with open(path, "r+b") as f:
        f.seek(data_start)
        while remaining:
            count = min(CHUNK, remaining)
            f.write(bytes(count))
            remaining -= count
        f.flush()
        os.fsync(f.fileno())


def worker(args: argparse.Namespace) -> None:
    """One rank: load, keep a copy of the local weights, let rank 0 rewrite the file, then compare or read."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = load(args.worker, args.model)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    before = [t.detach().clone() for t in local]
    dist.barrier()
    if dist.get_rank() == 0:
        rewrite(os.path.join(args.model, "model.safetensors"), args.mode)
    dist.barrier()
    with torch.no_grad():
        total = sum(t.numel() * t.element_size() for t in local)
        changed = sum(int((t != b).sum()) * t.element_size() for t, b in zip(local, before, strict=True))
    counts = torch.tensor([changed, total], dtype=torch.float64)
    dist.all_reduce(counts)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"changed_pct": 100 * float(counts[0] / counts[1]), "outcome": "ran to the end"}, f)
    dist.destroy_process_group()


def run(system: str, mode: str, source: str, workdir: str) -> dict:
    """One 2-rank run on a fresh copy of the checkpoint; what it measured, or how it died."""
    model = os.path.join(workdir, f"{system}-{mode}")
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(source, model)
    result = os.path.join(workdir, f"{system}-{mode}.json")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.abspath(__file__)),
        *("--worker", system, "--mode", mode, "--model", model, "--result", result),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode == 0:
        with open(result) as f:
            return json.load(f)
    if "SIGBUS" in proc.stdout:
        return {"changed_pct": None, "outcome": "killed by SIGBUS"}
    raise RuntimeError(f"run failed: {' '.join(command)}\n{proc.stdout[-6000:]}")


def render(results: dict[str, dict[str, dict]]) -> str:
    """A markdown table: one row per system, one column per rewrite."""
    lines = [
        "| system | file's tensor bytes zeroed in place: weight bytes changed | file cut to half its size |",
        "|---|---:|---|",
    ]
    for system, modes in results.items():
        zero = modes.get("zero")
        changed = "–" if zero is None else f"{zero['changed_pct']:.0f}%"
        truncate = modes.get("truncate", {}).get("outcome", "–")
        lines.append(f"| {system} | {changed} | {truncate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    with tempfile.TemporaryDirectory() as workdir:
        source = os.path.join(workdir, "llama")
        build_model(source, args.layers, hidden=args.hidden, vocab=args.vocab)
        results = {
            system: {mode: run(system, mode, source, workdir) for mode in args.modes.split(",")}
            for system in args.systems.split(",")
        }
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
