"""AdamW's step on the host, as cpu_offload=True runs it: torch's fused CPU kernel, foreach, and the for-loop, on
fully_shard'ed fp32 parameters (DTensor shards on a world of one over gloo) with gradients beside them.

cpu_offload keeps every shard, gradient and optimizer state in host memory, so each optimizer step is AdamW over all
parameters on the CPU: Trainer's default optim='adamw_torch_fused' (transformers 5.24 on torch >= 2.8) runs torch's
fused CPU kernel, optim='adamw_torch' the for-loop (torch picks foreach only for CUDA tensors); foreach is asked with
`foreach=True`. Each implementation gets its own optimizer over the same parameters and gradients; after one warm-up
step each (which allocates the state), the three step in turn, round after round, so a drift in the machine's speed
reaches all three alike. Per implementation: min, median and max seconds per step, and parameters per second at the
median.

Usage:
    python scripts/measure/measure_offload_adamw.py [--params 100e6] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6, help="fp32 parameters (default 100M)")
    parser.add_argument("--dim", type=int, default=2048, help="rows of each weight (Llama-3.2-1B's hidden size)")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each implementation")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    return parser.parse_args(argv)


def sharded_parameters(params: float, dim: int) -> list[Any]:
    """fp32 weights of dim x 4 dim (an MLP projection's shape) summing to about `params`, fully_shard'ed one by one on
    a mesh of the host (DTensor shards in host memory, as cpu_offload hands them to the optimizer), each with a
    gradient."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    count = max(1, round(params / (4 * dim * dim)))
    model = nn.Sequential(*[nn.Linear(4 * dim, dim, bias=False) for _ in range(count)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.grad = param.detach().clone()
        param.grad.to_local().normal_(generator=generator)
    return list(model.parameters())


def measure(params: list[Any], rounds: int) -> dict[str, list[float]]:
    """Seconds of each implementation's steps, interleaved round by round after one warm-up step each."""
    import torch

    optimizers = {name: torch.optim.AdamW(params, lr=1e-5, **kw) for name, kw in IMPLEMENTATIONS.items()}
    for optimizer in optimizers.values():
        optimizer.step()
    seconds: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    params = sharded_parameters(args.params, args.dim)
    total = sum(p.numel() for p in params)
    rows = []
    for name, times in measure(params, args.rounds).items():
        median = statistics.median(times)
        rows.append(
            {
                "implementation": name,
                "params": total,
                "threads": torch.get_num_threads(),
                "step_s": {"min": min(times), "median": median, "max": max(times)},
                "params_per_s": total / median,
            }
        )
        print(
            f"{name:9s} {total / 1e6:.0f}M params, {rows[-1]['threads']} threads: step {min(times):.3f} / "
            f"{median:.3f} / {max(times):.3f} s (min / median / max), {total / median / 1e9:.2f} G params/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "rounds": args.rounds}, f, indent=1)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
