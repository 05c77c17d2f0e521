"""Muon's step on fully_shard'ed parameters: torch.optim.Muon on the DTensors against hf_fsdp2's owner-based step.

Both optimizers get the same groups (every matrix of `--blocks` blocks of two `--dim` x `--dim` Linears, each block
and the root fully_shard'ed on a 1-D gloo mesh of the CPU) and the same gradients (a fixed elementwise function of
the weights), so only the step differs. torch's step runs every matrix's Newton–Schulz on every rank as DTensor
matmuls (the partial products reduced across ranks); hf_fsdp2's (`make_shard_exact`) gathers each matrix on one owner
rank, orthogonalises it there once and scatters the update back. Per step and rank it records the wall time (median
of `--steps` after 2 warm-up steps, all ranks waiting for the slowest) and the bytes the rank hands to collectives as
input: torch.distributed's gather/scatter/all_reduce calls (a scatter's source counts its whole list) and, for
DTensor, the inputs of the functional collectives (`torch.distributed._functional_collectives`) it calls.

Usage:
    python scripts/measure/measure_muon.py [--nprocs 2 4] [--json scripts/results/muon_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--from-json", default=None, help="print the docs table of a results file, run nothing")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def count_bytes(counter: dict[str, int]) -> None:
    """Count into counter["bytes"] the input bytes of torch.distributed's collectives and of the functional ones
    DTensor calls (patched at the module attributes their callers look up at call time)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def nbytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        return sum(nbytes(v) for v in value) if isinstance(value, (list, tuple)) else 0

    def patch(module: Any, name: str, which: int, keyword: str) -> None:
        original = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter["bytes"] += nbytes(args[which] if len(args) > which else kwargs.get(keyword))
            return original(*args, **kwargs)

        setattr(module, name, counted)

    for name, which, keyword in (("gather", 0, "tensor"), ("scatter", 1, "scatter_list"), ("all_reduce", 0, "tensor")):
        patch(dist, name, which, keyword)
    for name in (
        "all_reduce",
        "all_gather_single",
        "reduce_scatter_single",
        "all_gather_tensor",
        "reduce_scatter_tensor",
    ):
        patch(funcol, name, 0, "self")


def worker(optimizer_name: str, dim: int, blocks: int, steps: int, out: str) -> None:
    """One rank: build, shard, step `steps` + 2 times; rank 0 writes the medians."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hf_fsdp2.optim.muon import make_shard_exact

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)) for _ in range(blocks))
    )
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Muon(model.parameters(), lr=0.02)
    if optimizer_name == "hf_fsdp2":
        make_shard_exact(optimizer)
    counter = {"bytes": 0}
    count_bytes(counter)
    times, sent = [], []
    for step in range(steps + 2):
        for param in model.parameters():
            local = torch.sin(param.to_local().detach() * 7 + step)
            param.grad = DTensor.from_local(local, mesh, param.placements, shape=param.shape, stride=param.stride())
        dist.barrier()
        counter["bytes"] = 0
        start = time.perf_counter()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        sent.append(counter["bytes"])
    total = torch.tensor([float(sent[-1])])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        row = {"optimizer": optimizer_name, "nproc": dist.get_world_size(), "matrices": 2 * blocks, "dim": dim}
        row |= {
            "step_median_s": statistics.median(times[2:]),
            "sent_per_rank_mib": total.item() / dist.get_world_size() / 2**20,
        }
        with open(out, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """The docs table of a results file's rows."""
    lines = ["| ranks | optimizer | step (median) | sent per rank per step |", "|---:|---|---:|---:|"]
    for r in rows:
        name = "`torch.optim.Muon` on DTensors" if r["optimizer"] == "torch" else "hf_fsdp2 (owner-based)"
        lines.append(f"| {r['nproc']} | {name} | {r['step_median_s']:.3f} s | {r['sent_per_rank_mib']:.2f} MiB |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            return print(render_markdown(json.load(f)["rows"]))
    if args.worker:
        worker(args.worker, args.dim, args.blocks, args.steps, os.environ["MEASURE_OUT"])
        return
    work, rows = tempfile.mkdtemp(prefix="hf_fsdp2_muon_"), []
    for nproc in args.nprocs:
        for name in ("torch", "hf_fsdp2"):
            out = os.path.join(work, f"{name}-{nproc}.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MEASURE_OUT": out}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            command += [os.path.abspath(__file__), "--worker", name, "--dim", str(args.dim)]
            command += ["--blocks", str(args.blocks), "--steps", str(args.steps)]
            subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            with open(out) as f:
                rows.append(json.load(f))
    print(f"Muon step on {2 * args.blocks} fully_shard'ed {args.dim}x{args.dim} matrices (gloo, CPU):")
    print(render_markdown(rows))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"dim": args.dim, "blocks": args.blocks, "steps": args.steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
