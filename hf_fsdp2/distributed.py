"""The process group, the device and the device mesh: the only module that reads torchrun's environment.

Started by torchrun (RANK/LOCAL_RANK/WORLD_SIZE set) it joins that job; started as a plain `python`
process it becomes a world of one, so the same code runs on a laptop. It knows nothing about models.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# NOTE: imported before any process group exists on purpose. On its first import this torch module binds
# the then-current default group as the default argument of its collectives, and DDP and DTensor import it
# lazily, after the group is up: that hidden reference keeps a destroyed group (and, with gloo, its
# threads and sockets) alive until the interpreter exits.
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh
from transformers.utils import logging

logger = logging.get_logger(__name__)


def get_device() -> torch.device:
    """Return this rank's accelerator (by LOCAL_RANK) or the CPU.

    NOTE: LOCAL_RANK modulo the device count, as Accelerate picks it, so that ranks sharing a device
    (`hf_fsdp2.shared_device`) and Accelerate agree on it; with one rank per device it is LOCAL_RANK itself.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed() -> None:
    """Join torchrun's process group, or start a world of one; reuse a group that already exists.

    Either way the group is ended at a normal interpreter exit (see `_close_at_exit`), so an unchanged
    Trainer script needs no extra line. That includes a group Accelerate started for TrainingArguments
    under torchrun: nothing uses a process group once the interpreter is exiting.
    """
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_close_at_exit)
        _exit_handler_registered = True
        _warn_if_restarts_will_fail(os.environ)
    if dist.is_initialized():
        return
    device = get_device()
    # NOTE: gloo beside NCCL for the CPU tensors that CPU offload puts in collectives (torchtitan and torchtune do
    # the same); the accelerator's tensors still go over NCCL.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device.type == "cuda" else None
    prefix = restart_store_prefix(os.environ)
    if prefix is not None:
        _join_under_prefix(backend, prefix, device_id)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, device_id=device_id)
    else:
        # NOTE: a world of one needs no rendezvous; a HashStore keeps it free of ports and files.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def restart_store_prefix(env: Mapping[str, str]) -> str | None:
    """The store prefix that keeps a restarted torchrun attempt's keys apart from the dead attempt's, or None.

    torchrun lets its workers use the agent's own rendezvous TCPStore and keeps that store across restarts;
    torch's env:// init then adds no per-attempt prefix, so the workers of a restarted attempt can read the
    addresses the killed workers left behind and fail with "Gloo connectFullMesh failed ... Connection
    refused" (pytorch issues 135712 and 167288; 1 restart in 3 on this project's CPU drill). Under one agent
    every worker of an attempt has the same TORCHELASTIC_RESTART_COUNT, so that count makes a safe prefix.
    Agents on several nodes count restarts apart (a node restarted for another's failure does not count
    it), so there torchrun's own switch is the fix: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    """
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts == "0" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    return f"hf_fsdp2/attempt_{restarts}/"


def _join_under_prefix(backend: str, prefix: str, device_id: torch.device | None) -> None:
    """Join torchrun's group through the agent's store, with every key under `prefix`."""
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False)
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, device_id=device_id
    )


def start_restarted_worker() -> None:
    """Join a restarted single-node torchrun attempt at import, before TrainingArguments joins it the failing way.

    Accelerate starts the group inside `TrainingArguments(...)`, which a script builds before any
    hf_fsdp2 code runs; importing hf_fsdp2 is the one earlier point. Only a worker that torchrun restarted
    and that shares the agent's store does anything here; Accelerate then finds the group started.
    """
    if restart_store_prefix(os.environ) is not None and not dist.is_initialized():
        init_distributed()


def _warn_if_restarts_will_fail(env: Mapping[str, str]) -> None:
    """Say at the first launch when torchrun may restart workers across nodes that share the agent's store."""
    if (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
        and env.get("GROUP_WORLD_SIZE", "1") != "1"
        and env.get("RANK") == "0"
    ):
        logger.warning(
            "torchrun may restart these workers (--max-restarts %s) on %s nodes that share the agent's "
            "rendezvous store: a restart can then fail with 'Gloo/NCCL connect ... refused' (stale addresses). "
            "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.",
            env["TORCHELASTIC_MAX_RESTARTS"],
            env["GROUP_WORLD_SIZE"],
        )


_exit_handler_registered = False
# How long a rank that exits normally waits at exit for the others before it leaves without the barrier.
EXIT_BARRIER_TIMEOUT = timedelta(minutes=5)


def _close_at_exit() -> None:
    """End the group at a normal interpreter exit; after an uncaught exception leave it to torchrun.

    NOTE: Python sets `sys.last_value` (`sys.last_exc` from 3.12) when an uncaught exception ends the
    program, before atexit handlers run. A failing rank must not wait in a barrier that the other ranks,
    stuck in a collective, will never reach.
    """
    if not dist.is_initialized() or getattr(sys, "last_exc", None) or getattr(sys, "last_value", None):
        return
    close_distributed(timeout=EXIT_BARRIER_TIMEOUT)


def close_distributed(timeout: timedelta | None = None) -> None:
    """End the process group on every rank once the job has succeeded, and free it; a no-op without one.

    NOTE: a gloo group still alive at interpreter exit can abort a successful run (SIGABRT, "terminate
    called without an active exception"), and NCCL warns. `destroy_process_group` alone does not free the
    group: DTensor's caches keep device meshes alive, and a mesh holds its groups, so the group's threads
    and sockets outlive it. The barrier keeps a rank from tearing down while another still talks; with a
    `timeout`, a rank whose peers do not arrive in time leaves the group as it is instead of hanging. Called
    by itself at a normal exit once hf_fsdp2 has joined a group (`init_distributed`); call it to end it earlier.
    """
    if not dist.is_initialized():
        return
    try:
        dist.barrier(async_op=True).wait(timeout=timeout) if timeout is not None else dist.barrier()
    except RuntimeError as error:
        logger.warning("Leaving the process group without ending it: the other ranks did not arrive (%s).", error)
        return
    dist.destroy_process_group()
    _release_mesh_groups()


def _release_mesh_groups() -> None:
    """Drop the destroyed groups that live device meshes still hold, so the groups are really freed."""
    for obj in gc.get_objects():
        # NOTE: type(), not isinstance: isinstance on a weak proxy whose target is gone (torch.compile
        # leaves them behind) raises ReferenceError, and that would fail a run that succeeded.
        if issubclass(type(obj), DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()  # private in torch 2.13; absent elsewhere is harmless
    gc.collect()  # frees the groups that only reference cycles still reached


# Groups created for CPU-side work (monitored barriers, CPU flags, DCP's metadata exchange): gloo even when the
# job's own groups are NCCL. Every other group is taken to serve the accelerator (see `collective_device`).
_host_groups: list[dist.ProcessGroup] = []
# False only inside `communicate_when_alone()`: then a group of one rank runs its collectives as any other would.
_shortcut_when_alone = True


def new_host_group() -> dist.ProcessGroup:
    """A new gloo group over all ranks, for CPU tensors and monitored barriers (collective: every rank calls it)."""
    group = dist.new_group(backend="gloo")
    _host_groups.append(group)
    return group


def close_host_group(group: dist.ProcessGroup) -> None:
    """Destroy a group from `new_host_group` and forget it."""
    _host_groups[:] = [host for host in _host_groups if host is not group]
    dist.destroy_process_group(group)


def made_for_host(group: dist.ProcessGroup | None) -> bool:
    """True for a group made by `new_host_group` (gloo whatever the job's backend)."""
    return any(group is host for host in _host_groups)


def is_host_group(group: dist.ProcessGroup | None) -> bool:
    """True when `group` takes CPU tensors: a group made by `new_host_group`, or any group of a gloo-only job."""
    return made_for_host(group) or str(dist.get_backend(group)) == "gloo"


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of the tensors `group` takes: the CPU for gloo groups, this rank's accelerator otherwise.

    NOTE: an NCCL group rejects CPU tensors ("No backend type associated with device type cpu"); gloo on the CPU
    takes any tensor this project makes, so a wrong device never fails in the CPU suite. Every small tensor this
    package hands to a collective is made here (`agree`), or on the device of the tensors it reduces.
    """
    return torch.device("cpu") if is_host_group(group) else get_device()


def alone(group: dist.ProcessGroup | None = None) -> bool:
    """True when there is nobody to talk to (no group, or a group of one) and collectives may be skipped."""
    if not dist.is_initialized():
        return True
    return _shortcut_when_alone and dist.get_world_size(group) == 1


@contextlib.contextmanager
def communicate_when_alone() -> Iterator[None]:
    """Run every collective even in a group of one, so a one-GPU machine drives each path through NCCL.

    Used by the GPU check (`scripts/measure/gpu_check.py`, part "collectives"), not by training.
    """
    global _shortcut_when_alone
    _shortcut_when_alone = False
    try:
        yield
    finally:
        _shortcut_when_alone = True


def agree(
    values: Sequence[float], op: str, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
) -> list[float]:
    """All ranks' `values` reduced elementwise by `op` ("max", "min" or "sum"): the one way small flags and counts
    cross ranks, so their tensor is always on the device `group` takes.

    NOTE: collective over `group`; every rank calls it with the same number of values. With `timeout`, a rank whose
    peers do not arrive in time raises instead of waiting for ever.
    """
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
    if op not in ops:
        raise ValueError(f"agree: op={op!r} is not one of {sorted(ops)}")
    if alone(group):
        return list(values)
    flags = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    work = dist.all_reduce(flags, op=ops[op], group=group, async_op=True)
    work.wait(timeout) if timeout is not None else work.wait()
    return flags.tolist()


def get_rank() -> int:
    """Return the global rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    """True on the rank that speaks for the job (logs, writes shared files)."""
    return get_rank() == 0


def log_rank0(message: str, *args: Any) -> None:
    """Log at INFO on rank 0 only, so N ranks do not print N copies (under the caller's line)."""
    if is_rank0():
        logger.info(message, *args, stacklevel=2)


def warn_rank0(message: str, *args: Any) -> None:
    """Warn on rank 0 only (under the caller's line)."""
    if is_rank0():
        logger.warning(message, *args, stacklevel=2)


def check_same_on_all_ranks(what: str, value: Any) -> None:
    """Fail on every rank, naming the first rank that differs, when ranks disagree about `value`.

    NOTE: run before any sharding collective, so a mismatched config fails loudly instead of hanging.

    Raises:
        ValueError: when a rank's `value` differs from rank 0's (ranks run different scripts or arguments).
    """
    if alone():
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    for rank, other in enumerate(gathered):
        if other != gathered[0]:
            raise ValueError(
                f"rank {rank} has a different {what} than rank 0: {other!r} != {gathered[0]!r}. "
                "Every rank must run the same script with the same arguments."
            )


def first_on_any_rank(value: Any) -> tuple[int, Any]:
    """Return (rank, value) of the lowest rank whose value is set, else (-1, None); the same on every rank.

    NOTE: collective; every rank must call it, whatever its own value.
    """
    gathered: list[Any] = [value]
    if not alone():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
    return next(((rank, found) for rank, found in enumerate(gathered) if found), (-1, None))


def raise_if_any_rank(problem: Any) -> None:
    """Raise the first rank's problem on every rank, so a failure on one rank never leaves others waiting.

    Raises:
        ValueError: when any rank passed a problem; the message names the lowest such rank and its problem.
    """
    rank, found = first_on_any_rank(problem)
    if found:
        raise ValueError(f"rank {rank}: {found}")


def broadcast_from_rank0(value: Any) -> Any:
    """Return rank 0's `value` on every rank (small picklable objects: RNG states, adapter tensors).

    NOTE: collective; every rank must call it.
    """
    if alone():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
