"""Drive every collective the package makes, once each, on tiny tensors: the GPU check's part "collectives".

    python scripts/measure/collective_paths.py [--json out.json] [--paths a,b]   # a world of one (GPU: NCCL)
    torchrun --nproc_per_node 2 scripts/measure/collective_paths.py               # two ranks

Each path is one of the package's own functions that hands tensors to `torch.distributed` (small agreements,
Muon's owner exchange, Adafactor's statistics, preemption, disk space, branches, the router loss, scalar
gradients, generation's fit check, buffers, owner exports, NF4 statistics, checkpoint saves). Under
`communicate_when_alone()` a world of one runs them all too, so one GPU hands NCCL every tensor: a tensor on the
wrong device fails there ("No backend type associated with device type cpu") as it would on N GPUs.
`tests/test_collectives.py` runs the same paths at 2 CPU ranks under a device audit.

Prints one line per path (ok, or the error) and returns the results as a dict (`run_paths`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import hf_fsdp2.distributed as distributed
from hf_fsdp2.meshes import build_mesh

PATHS: dict[str, Callable[[], None]] = {}


def path(fn: Callable[[], None]) -> Callable[[], None]:
    """Register one collective path under its function's name."""
    PATHS[fn.__name__] = fn
    return fn


def _sharded_pair(bias: bool = True) -> nn.Module:
    """Two Linear layers, each its own FSDP2 unit on the job's mesh, with gradients from one backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40, bias=bias), nn.Tanh(), nn.Linear(40, 24, bias=bias))
    model.to(distributed.get_device())
    mesh = build_mesh()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(6, 24, device=distributed.get_device())).square().mean().backward()
    return model


@path
def small_agreements() -> None:
    """`agree` and the object helpers every check uses."""
    rank = distributed.get_rank()
    assert distributed.agree([rank, -rank], "max") == [dist.get_world_size() - 1, 0]
    distributed.check_same_on_all_ranks("value", 7)
    assert distributed.first_on_any_rank(None) == (-1, None)
    distributed.raise_if_any_rank(None)
    assert distributed.broadcast_from_rank0(rank) == 0


@path
def muon_owner_exchange() -> None:
    """Muon's gather/scatter of split matrices and its owner-failure agreement."""
    from hf_fsdp2.optim.muon import MuonAdamW

    model = _sharded_pair()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    optimizer = MuonAdamW([{"params": matrices, "use_muon": True}, {"params": others, "use_muon": False}])
    optimizer.step()
    assert optimizer.owned_last_step >= 0


@path
def adafactor_statistics() -> None:
    """Adafactor's row/column statistics summed over the shard group."""
    from transformers.optimization import Adafactor

    from hf_fsdp2.optim.adafactor import make_adafactor_exact

    model = _sharded_pair()
    optimizer = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=True)
    make_adafactor_exact(optimizer)
    optimizer.step()


@path
def preemption_agreement() -> None:
    """The stop flag every rank agrees on after a step."""
    from hf_fsdp2.trainer.preemption import PreemptionWatcher

    watcher = PreemptionWatcher(["SIGUSR1"])
    with watcher.watching():
        assert watcher.agreed_stop(1) == 0
    assert signal.getsignal(signal.SIGUSR1) is not None


@path
def disk_space_check() -> None:
    """Free space gathered from every rank before a save."""
    from hf_fsdp2.checkpoints.disk_space import check_room

    with tempfile.TemporaryDirectory() as folder:
        assert check_room(folder, 1) >= 1


@path
def branch_gradients() -> None:
    """Whether any rank ran a branch in this step (vision towers, experts)."""
    from hf_fsdp2.loading.branches import BranchGuard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(distributed.get_device())
    guard = BranchGuard(model, ["0"], None)
    model(torch.randn(2, 4, device=distributed.get_device())).sum().backward()
    guard.before_optimizer_step()
    for handle in guard.handles:
        handle.remove()


@path
def router_loss_totals() -> None:
    """MoE router counts summed over ranks."""
    from hf_fsdp2.trainer.router_loss import global_router_loss

    logits = (torch.randn(10, 4, device=distributed.get_device()),)
    share, local = global_router_loss(logits, experts=4, top_k=2, mask=None)
    assert share.device == logits[0].device and torch.isfinite(share + local)


@path
def scalar_gradients() -> None:
    """0-dim parameters' gradients averaged in backward."""
    from hf_fsdp2.sharding.units import reduce_scalar_gradients

    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(2.0, device=distributed.get_device()))
    reduce_scalar_gradients(model)
    (model.scale * 3).backward()
    assert model.scale.grad.item() == 3.0


@path
def generation_fit_check() -> None:
    """Whether the gathered model fits on every rank, and the join check of collective methods."""
    from hf_fsdp2.sharding.collective_methods import all_ranks_join, gathered_fits

    model = _sharded_pair()
    all_ranks_join("the collective-path check")
    assert gathered_fits(model) in (True, False)


@path
def buffers_from_rank0() -> None:
    """Non-persistent buffers sent from rank 0 after loading."""
    from hf_fsdp2.loading.rank0_route import broadcast_buffers

    model = nn.Module()
    model.register_buffer("inv_freq", torch.full((4,), float(distributed.get_rank()), device=distributed.get_device()))
    broadcast_buffers(model)
    assert model.inv_freq.sum().item() == 0.0


@path
def owner_export_error() -> None:
    """Rank 0's export failure shared with every rank."""
    from hf_fsdp2.export.owner import share_error

    box: list[str | None] = [None]
    share_error(box)
    assert box == [None]


@path
def nf4_block_statistics() -> None:
    """NF4's block absmax gathered over the shard group (needs torchao)."""
    try:
        from hf_fsdp2.adapters.nf4 import global_mean_absmax
    except ImportError as error:  # NOTE: the qlora extra; the caller reports it as skipped
        raise ModuleNotFoundError(str(error)) from error
    rows = torch.randn(4, 128, device=distributed.get_device())
    mean, local = global_mean_absmax(rows, build_mesh().get_group())
    assert mean.device == rows.device and local.numel() == 8


@path
def sequence_parallel_rows() -> None:
    """Each member's rows gathered over the sequence group, and this rank's slice of each (a group of all ranks)."""
    from hf_fsdp2.long_rows.sequence_parallel import SequenceParallel

    world, device = dist.get_world_size(), distributed.get_device()
    ids = torch.arange(4 * world, device=device).reshape(1, -1)
    inputs = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(ids.shape[1], device=device)[None]}
    parts = list(SequenceParallel(world, "sdpa").parts(inputs, ids.numel()))
    assert len(parts) == world and all(part.inputs["input_ids"].shape[1] == 4 for part in parts)


@path
def checkpoint_parts() -> None:
    """A sharded save of model and optimizer, synchronous and asynchronous (DCP over the save groups)."""
    from hf_fsdp2.checkpoints.sharded_save import PartSavers, sharded_parts, wait_for_writes, write_parts

    model = _sharded_pair()
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    folder = distributed.broadcast_from_rank0(tempfile.mkdtemp() if distributed.is_rank0() else None)
    for async_save in (False, True):
        savers = PartSavers(async_save=async_save)
        try:
            for attempt in range(2):  # NOTE: twice: a stager reused by a second save broke on torch 2.11
                target = os.path.join(folder, f"{async_save}-{attempt}")
                failure = wait_for_writes(write_parts(target, sharded_parts(model, optimizer), savers))
                if failure is not None:
                    raise failure
        finally:
            savers.close()
    dist.barrier()


def run_paths(names: list[str] | None = None) -> dict[str, str]:
    """Run the named paths (default: all) inside `communicate_when_alone`; each one's "ok", "skipped: ..." or error."""
    results: dict[str, str] = {}
    with distributed.communicate_when_alone():
        for name in names or list(PATHS):
            try:
                PATHS[name]()
                results[name] = "ok"
            except ModuleNotFoundError as error:
                results[name] = f"skipped: {error}"
            except Exception as error:  # NOTE: every path is tried; the next one still runs
                results[name] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
    return results


def main() -> None:
    """Run every path in this process's job and print (and optionally write) the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default="", help="comma-separated subset of " + ", ".join(PATHS))
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = parser.parse_args()
    distributed.init_distributed()
    results = run_paths(args.paths.split(",") if args.paths else None)
    backend = str(dist.get_backend())
    if distributed.is_rank0():
        for name, outcome in results.items():
            print(f"{name:24s} {backend:6s} world {dist.get_world_size()}: {outcome}", flush=True)
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"backend": backend, "world_size": dist.get_world_size(), "paths": results}, file)
    failed = [name for name, outcome in results.items() if outcome != "ok" and not outcome.startswith("skipped")]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
