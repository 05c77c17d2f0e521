"""Room on disk for a save: the check before a checkpoint or export writes anything, and the one clear error every
rank raises when a write fails (a full disk above all), after the partial files are gone.

Knows folders and byte counts; nothing about models, DCP's files or the Trainer (callers pass what they write).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..distributed import alone, is_rank0

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What torch.save's C++ writer says when a write comes up short (it carries no errno): seen on a full disk as
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", "PytorchStreamWriter failed writing" and
# "basic_ios::clear: iostream error".
SHORT_WRITE_MARKS = ("unexpected pos", "PytorchStreamWriter failed", "iostream error")


class CheckpointWriteError(OSError):
    """A checkpoint or export could not be written; the message starts with the folder and the reason."""

    def __init__(self, code: int, message: str, folder: str) -> None:
        super().__init__(code, message, folder)

    def __str__(self) -> str:
        # NOTE: OSError's own str puts "[Errno N]" first and the folder last; the user reads this line first.
        return self.strerror

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.errno, self.strerror, self.filename)


class CheckpointDiskFull(CheckpointWriteError):
    """No space left on device for a checkpoint or export (errno ENOSPC)."""


def free_bytes(folder: str) -> int:
    """Bytes free to this user on the file system `folder` is (or will be created) on."""
    return shutil.disk_usage(_existing(folder)).free


def _existing(folder: str) -> str:
    """`folder` or its nearest existing ancestor (a run's first save creates output_dir)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


# DCP writes each tensor as its own torch.save record: measured 1.6 KB beyond the data per model tensor and 2.1 KB
# per optimizer state entry (tiny Llama, torch 2.13). 1 KB keeps the estimate a lower bound.
RECORD_BYTES = 1024


def tensor_bytes(state: Any) -> int:
    """Bytes this rank writes for the tensors in a (nested) state dict, at least: local shards of DTensors, each
    tensor once, and a record per tensor."""
    seen: set[int] = set()
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and id(item) not in seen:
            seen.add(id(item))
            local = item.to_local() if hasattr(item, "to_local") else item
            total += local.numel() * local.element_size() + RECORD_BYTES
    return total


def check_room(folder: str, own_bytes: int, what: str = "checkpoint", collective: bool = True) -> int:
    """Fail at once on every rank when a file system lacks room for what the ranks writing to it are about to write.

    Returns the bytes all ranks write to this rank's file system (a lower bound of what `folder` needs: file
    headers and small files are not counted, so a save is never refused that would fit).
    NOTE: collective; every rank calls it with its own bytes, before writing anything. `collective=False`: this
    process alone writes (offline consolidation, which one rank of a running job may call).

    Raises:
        CheckpointDiskFull: when any rank's file system has less free space than the bytes written to it.
    """
    free = free_bytes(folder)
    views = _gather((_file_system(folder), own_bytes, free), collective)
    needs = {key: sum(b for k, b, _ in views if k == key) for key, _, _ in views}
    short = next(((needs[key], got) for key, _, got in views if got < needs[key]), None)
    if short is not None:
        raise CheckpointDiskFull(errno.ENOSPC, _message(folder, what, *short, "before writing anything"), folder)
    return needs[_file_system(folder)]


def raise_if_write_failed(
    error: BaseException | None, folder: str, staging: str, need: int, what: str = "checkpoint", collective: bool = True
) -> None:
    """When any rank failed to write its part, remove the staging folder and raise one clear error on every rank.

    The error says "no space left on device" when the failure carries ENOSPC (anywhere in DCP's per-rank failures
    or an exception's causes) or when the file system, once the partial files are gone, has less room than `need`;
    else it names the failed write. A failure that is no write failure is re-raised as it is on its rank.
    NOTE: collective; every rank calls it after its own part, with its own error or None (`collective=False`: this
    process alone wrote).

    Raises:
        CheckpointDiskFull: a full disk on any rank.
        CheckpointWriteError: another failed write on any rank.
    """
    together = collective and not alone()
    failed_rank, found = _first(_describe(error) if error is not None else None, together)
    if found is None:
        return
    if together:
        dist.barrier()  # every rank has stopped writing into staging
    if is_rank0() or not together:
        shutil.rmtree(staging, ignore_errors=True)
    if together:
        dist.barrier()
    if isinstance(error, CheckpointWriteError):
        raise error  # already the clear error (the check before writing, raised alike on every rank)
    free = _gather(free_bytes(folder), together)[failed_rank]  # the failing rank's file system, after the cleanup
    code, detail = found
    where = f"rank {failed_rank}: {detail}" if together else detail
    if code is None:  # no write failed (a bug, an interrupt): that error itself, named on the other ranks
        if error is not None:
            raise error
        raise RuntimeError(f"{folder}: the {what} was not saved; {where}")
    if code in FULL_DISK_ERRNOS or free < need:
        raise CheckpointDiskFull(errno.ENOSPC, _message(folder, what, need, free, where), folder)
    message = (
        f"{folder}: the {what} could not be written ({where}); it needs at least {_size(need)}, {_size(free)} free. "
        "Nothing was kept of it and earlier checkpoints are untouched."
    )
    raise CheckpointWriteError(code, message, folder)


def _message(folder: str, what: str, need: int, free: int, detail: str) -> str:
    """The full-disk line: the folder, the words users search for, the bytes needed against the bytes free."""
    return (
        f"{folder}: no space left on device: the {what} needs at least {_size(need)}, the file system has "
        f"{_size(free)} free ({detail}). Nothing was kept of it and earlier checkpoints are untouched; free space "
        "or write elsewhere (output_dir), then relaunch (resume_from_checkpoint=True resumes from the last complete "
        "checkpoint)."
    )


def _size(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / 2**20:.1f} MiB)"


def _describe(error: BaseException) -> tuple[int | None, str]:
    """(errno of the first OSError in the failure, a one-line summary of it); errno None when there is none."""
    causes = list(_causes(error))
    first = next((cause for cause in causes if isinstance(cause, OSError) and cause.errno), None)
    full = next((cause for cause in causes if isinstance(cause, OSError) and cause.errno in FULL_DISK_ERRNOS), first)
    shown = full if full is not None else causes[-1]
    summary = " ".join(str(shown).split())[:300]
    code = full.errno if full is not None else None
    if code is None and any(mark in str(cause) for cause in causes for mark in SHORT_WRITE_MARKS):
        code = errno.EIO  # a short write without an errno: a failed write all the same
    return code, f"{type(shown).__name__}: {summary}"


def _causes(error: BaseException) -> list[BaseException]:
    """The error, its causes and contexts, and the per-rank failures a DCP CheckpointException carries."""
    found: list[BaseException] = []
    stack: list[Any] = [error]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):  # DCP wraps each rank's failure as (exception, traceback summary)
            stack.extend(part for part in item if isinstance(part, BaseException))
            continue
        if not isinstance(item, BaseException) or any(item is seen for seen in found):
            continue
        found.append(item)
        if isinstance(item, CheckpointException):
            stack.extend(item.failures.values())
        stack.extend(cause for cause in (item.__cause__, item.__context__) if cause is not None)
    return found


def _file_system(folder: str) -> tuple[str, int]:
    """Which file system `folder` is on, as seen from every rank: host and device number."""
    return socket.gethostname(), os.stat(_existing(folder)).st_dev


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(value: Any, collective: bool = True) -> list[Any]:
    """Every rank's `value`, in rank order (just this one's outside a process group, or not `collective`)."""
    if not collective or alone():
        return [value]
    gathered: list[Any] = [None] * _world()
    dist.all_gather_object(gathered, value)
    return gathered


def _first(value: Any, collective: bool = True) -> tuple[int, Any]:
    """(rank, value) of the lowest rank whose value is set, else (-1, None); the same on every rank."""
    return next(((rank, found) for rank, found in enumerate(_gather(value, collective)) if found), (-1, None))
