"""Run a torchrun job whose ranks share one GPU, under NCCL's device rules: try a multi-rank job on one GPU.

    torchrun --nproc_per_node 2 -m hf_fsdp2.shared_device train.py --your-args

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). This launcher starts the job's group before the
script runs, as gloo registered for CUDA tensors only (`cuda:gloo`), with every rank on the same device: gloo really
exchanges the CUDA tensors (through host memory), and a CPU tensor handed to the group fails with NCCL's own error,
as it does on the NCCL-only group Accelerate starts on N GPUs. hf_fsdp2's meshes add gloo for CPU tensors, as they
do beside NCCL. Every rank is given LOCAL_RANK 0, the device's index, so each counts as its node's first (duplicate
log lines). Slower than NCCL; for trying and testing, not for training. Gloo has no CUDA coalesced all-gathers,
point-to-point or `PREMUL_SUM`, so code that needs them fails here and not on NCCL.
On a machine without CUDA it starts no group and runs the script as plain torchrun would, so the same command
runs there.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .distributed import get_device

USAGE = "usage: torchrun --nproc_per_node N -m hf_fsdp2.shared_device SCRIPT [ARGS...] (or -m MODULE [ARGS...])"


def start_shared_group() -> torch.device:
    """Join torchrun's job with every rank on one GPU and NCCL's device rules; return this rank's device.

    Raises:
        ValueError: outside torchrun, or when the job's group is already started (its backend is then fixed).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(f"hf_fsdp2.shared_device runs under torchrun (RANK and WORLD_SIZE unset). {USAGE}")
    if dist.is_initialized():
        raise ValueError(
            "the process group is already started, so its backend cannot be chosen any more; "
            "run the script through `-m hf_fsdp2.shared_device` and do not start a group before it."
        )
    device = get_device()
    if device.type != "cuda":
        return device  # NOTE: nothing to share; the script starts its group as under plain torchrun
    torch.cuda.set_device(device)
    # NOTE: Accelerate's wait_for_everyone passes LOCAL_RANK as the barrier's device (cuda:1 does not exist on one
    # GPU), and TRL's vLLM reads it: every rank is told it is its node's first, on the one device.
    os.environ["LOCAL_RANK"] = str(device.index)
    # NOTE: no device_id: binding a device makes torch split groups with NCCL's comm split, which gloo lacks.
    dist.init_process_group(backend="cuda:gloo")
    return device


def main(argv: Sequence[str] | None = None) -> None:
    """Start the shared group, then run the script (or `-m module`) as `__main__` with its own arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    start_shared_group()
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit(USAGE)
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
