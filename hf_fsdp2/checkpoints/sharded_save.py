"""Writing a sharded checkpoint: each rank's parts (model, optimizer) through DCP into a hidden staging folder,
published under its final name by an atomic rename once every rank has written its part.

A save is synchronous (both parts written at once, each in its own thread) or asynchronous (copied to host memory
and written, both in the background; the caller waits for the copy before the state changes); `PartSavers` holds what
saves keep between checkpoints. The layout is `checkpoints.sharded`'s. This module knows nothing about the Trainer.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from ..distributed import get_device, is_rank0, new_host_group
from ..sharding.units import reshard_all
from .direct_io import DirectStream
from .sharded import MODEL_DIR, MODEL_KEY, OPTIMIZER_DIR, OPTIMIZER_KEY, model_state_dict, staging_dir


def begin_checkpoint(final: str) -> str:
    """Create a fresh staging folder for `final` (dropping a stale one a crash left behind)."""
    staging = staging_dir(final)
    if is_rank0():
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    return staging


def sharded_parts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, include_model: bool = True
) -> list[tuple[str, dict[str, Any]]]:
    """This rank's state to save, as (folder, DCP state) per part: the model and the optimizer.

    `include_model=False` leaves the model out (adapter checkpoints keep the weights in peft's files).
    """
    # NOTE: a forward under no_grad (evaluate) leaves the units that skip resharding after forward (the root, the
    # last block) gathered, their unsharded tensors registered on the modules; the optimizer's state is keyed by
    # the sharded ones, which torch then cannot name (KeyError), unless a model state dict put them back first.
    reshard_all(model)
    parts = [(MODEL_DIR, {MODEL_KEY: model_state_dict(model)})] if include_model else []
    if optimizer is not None:
        parts.append((OPTIMIZER_DIR, {OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)}))
    return parts


class HostStager(AsyncStager):
    """One part's copy in host memory for asynchronous saves: buffers allocated at the first save and refilled by
    every later one (pinned where the state is on CUDA), the copy made in a background thread.

    `stage` returns at once with a future of the copy, which DCP's writer waits for; the caller must wait for it too
    (`wait_for_staging`) before anything changes the state being copied (the next optimizer step). On an accelerator
    the copy runs on a stream of its own that first waits for the work already queued on the current stream (the
    optimizer step that made the state), so what is copied is the state as of `stage`.

    NOTE: why not torch's own stagers. torch 2.11's `DefaultStager` empties its buffer cache at the end of every
    `stage` (its `_stage` closes its `StateDictStager`), whatever its options, so each save allocated and pinned the
    whole state again (13.8 GiB for 1B + AdamW); `BlockingAsyncStager(cache_staged_state_dict=True)` keeps its
    buffers but pins them even without CUDA (a CPU-only torch raises) and copies in the caller's thread; and
    `DefaultStager`'s non-blocking asynchronous copies run on a stream of its own that nothing orders after the
    compute stream. Every torch in the supported range has the same `StateDictStager` (torch 2.11-2.15: same
    signature, its cache keyed by the source storage, held weakly), which this uses directly and never closes between
    saves (tests/test_checkpoint.py::test_every_async_save_of_a_run_holds_exactly_its_state_and_reuses_its_host_buffers
    checks the reuse; it passes on torch 2.11, 2.13 and 2.15).
    """

    _synchronize_after_execute = False  # the caller waits for the returned future

    def __init__(self) -> None:
        self._copier: StateDictStager | None = None  # made at the first save, when the state's device is known
        self._stream: torch.Stream | None = None
        self._device: torch.device | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_fsdp2-staging")
        self._last: dict[str, Any] | None = None  # the last copy, kept alive until the next one is made
        self.pinned = False
        # Whether the last copy went into the previous copy's host buffers (None: the first copy). While the previous
        # copy is alive no new buffer can share its address, so equal addresses mean nothing was allocated.
        self.buffers_reused: bool | None = None

    def stage(self, state_dict: dict[str, Any], **_: Any) -> Future:
        """Start copying `state_dict` to host memory; the future holds the copy."""
        if self._copier is None:
            self._device = _accelerator_device(state_dict)
            self.pinned = self._device is not None and self._device.type == "cuda"
            self._copier = StateDictStager(pin_memory=self.pinned, share_memory=False)
            if self._device is not None:
                self._stream = torch.Stream(device=self._device)
        if self._stream is not None:
            # NOTE: queued here, in the caller's thread: the copies start after the work queued so far (the step).
            self._stream.wait_stream(torch.accelerator.current_stream(self._device))
        return self._executor.submit(self._copy, self._copier, state_dict)

    def _copy(self, copier: StateDictStager, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Runs in the staging thread: fill the host buffers (allocated on first use) and wait for the copies."""
        if self._stream is None:
            staged = copier.stage(state_dict, non_blocking=False)
        else:
            torch.get_device_module(self._stream.device.type).set_device(self._stream.device)
            with self._stream:
                staged = copier.stage(state_dict, non_blocking=True)
            self._stream.synchronize()
        if self._last is not None:
            self.buffers_reused = set(_storage_addresses(staged)) == set(_storage_addresses(self._last))
        self._last = staged
        return staged

    def synchronize_staging(self) -> None:
        """Nothing: `stage`'s future is waited for instead."""

    def close(self) -> None:
        """Wait for a copy in flight, then free the host buffers."""
        self._executor.shutdown(wait=True)
        self._last = None
        if self._copier is not None:
            self._copier.close()
            self._copier = None


def _accelerator_device(state: Any) -> torch.device | None:
    """The device of the first tensor in `state` that is not in host memory (None: all are)."""
    if isinstance(state, torch.Tensor):
        return state.device if state.device.type not in ("cpu", "meta") else None
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list | tuple) else ()
    for value in values:
        device = _accelerator_device(value)
        if device is not None:
            return device
    return None


def _storage_addresses(state: Any) -> Iterator[int]:
    """The host addresses of the storages under `state` (a DTensor's: its local tensor's)."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        yield local.untyped_storage().data_ptr()
    elif isinstance(state, dict):
        for value in state.values():
            yield from _storage_addresses(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from _storage_addresses(value)


class PartSavers:
    """What saves keep between checkpoints: a gloo group per part (model, optimizer) and, for asynchronous saves, a
    gloo group for the training thread's written-yet flags and a `HostStager` per part, whose host buffers are
    allocated at the first save and refilled by every later one (on every torch in the supported range), plus device
    copies of the model's plain tensors.

    NOTE: each part's DCP save runs its collectives in its own thread (the model's beside the optimizer's in a sync
    save, both in the background in an async one); sharing a group between them (or with training) lets them
    interleave differently on each rank and deadlock.
    """

    def __init__(self, async_save: bool = False) -> None:
        self.groups = {part: new_host_group() for part in (MODEL_DIR, OPTIMIZER_DIR)}
        self.stagers = {part: HostStager() for part in (MODEL_DIR, OPTIMIZER_DIR)} if async_save else {}
        # The training thread's own gloo group for "is the pending save written?" at each step's end: a CPU flag, so
        # asking never waits for the accelerator's queued work, and apart from the parts' groups the writes use.
        self.written_flags = new_host_group() if async_save else None
        self._snapshots: dict[str, torch.Tensor] = {}

    def snapshot_plain_tensors(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` (the model part) with each plain tensor replaced by a copy on its device, made now.

        NOTE: an asynchronous save copies to host memory while training goes on, until the next optimizer step.
        FSDP2's parameters (DTensors) and the optimizer's state change only in that step; a plain tensor of the model
        is a buffer, which a forward may update (BatchNorm's running statistics), so it is copied now, on the
        device's stream (ordered before the host copy). The copies are kept, so the host buffers behind them are too.
        """
        out = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                kept = self._snapshots.get(key)
                if kept is None or (kept.shape, kept.dtype, kept.device) != (value.shape, value.dtype, value.device):
                    kept = self._snapshots[key] = torch.empty_like(value)
                value = kept.copy_(value)
            out[key] = value
        return out

    def buffers_reused(self) -> bool | None:
        """Whether the last asynchronous save copied into the host buffers of the one before (None: no such save)."""
        reused = [stager.buffers_reused for stager in self.stagers.values()]
        return None if not reused or None in reused else all(reused)

    def close(self) -> None:
        """Free the host buffers (waiting for a copy in flight)."""
        for stager in self.stagers.values():
            stager.close()
        self._snapshots.clear()


def write_parts(
    directory: str, parts: list[tuple[str, dict[str, Any]]], savers: PartSavers, direct: bool = False
) -> list[Any]:
    """Write this rank's `parts` (from `sharded_parts`) under `directory`; `direct=True` writes with O_DIRECT
    (FSDP2Config.checkpoint_writes="direct").

    With stagers in `savers` (async) it returns at once: each part is copied to host memory in a background thread
    (`wait_for_staging` waits for the copies: call it before the state changes) and then written in another; the
    returned responses' `upload_completion` finishes when it is on disk (`wait_for_writes`). Otherwise the parts are
    written at once, each in its own thread, and it returns [] once both are on disk.
    NOTE: the stagers' host buffers hold the last save's copy until its writes end: the caller waits for those
    (`wait_for_writes`) before it saves again.
    """
    writers = {folder: storage_writer(os.path.join(directory, folder), direct) for folder, _ in parts}
    if savers.stagers:
        pending = []
        for folder, state in parts:
            if folder == MODEL_DIR:
                state = {MODEL_KEY: savers.snapshot_plain_tensors(state[MODEL_KEY])}
            pending.append(
                dcp.async_save(
                    state,
                    storage_writer=writers[folder],
                    process_group=savers.groups[folder],
                    async_stager=savers.stagers[folder],
                )
            )
        return pending
    # NOTE: one part's writes and fsyncs overlap the other's (scripts/measure/measure_save_parts.py: 100M Llama,
    # 2 CPU ranks, 6 interleaved repeats, medians: 1.22 s one after the other, 1.08 s at once;
    # FileSystemWriter(thread_count=2) one after the other: 1.32 s).
    run_at_once(
        [
            functools.partial(dcp.save, state, storage_writer=writers[folder], process_group=savers.groups[folder])
            for folder, state in parts
        ]
    )
    return []


def wait_for_staging(pending: list[Any]) -> BaseException | None:
    """Wait until every asynchronous part of a save (from `write_parts`) is copied to host memory, after which the
    live state may change; return the first failure, not raise it (its writes fail with it: `wait_for_writes` reports
    it where every rank learns of it)."""
    failure = None
    for save in pending:
        staged = getattr(save, "staging_completion", None)
        if staged is None:
            continue
        try:
            staged.result()
        except Exception as error:  # noqa: BLE001 - returned to the caller
            failure = failure or error
    return failure


def writes_done(pending: list[Any]) -> bool:
    """Whether every asynchronous part of a save (from `write_parts`) has stopped writing on this rank, finished or
    failed, without waiting for it."""
    return all(getattr(save, "upload_completion", save).done() for save in pending)


def wait_for_writes(pending: list[Any]) -> BaseException | None:
    """Wait for every asynchronous part of a save (from `write_parts`); return the first failure, not raise it, so
    the caller can remove the partial folder once nothing writes into it any more."""
    failure = None
    for save in pending:
        try:
            getattr(save, "upload_completion", save).result()
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            failure = failure or error
    return failure


def run_at_once(calls: list[Callable[[], Any]]) -> None:
    """Run each call in its own thread (the last in this one) and wait for all; re-raise the first failure.

    The threads use this thread's accelerator, whose "current device" is per thread.
    """
    device = get_device()
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            if device.type != "cpu":
                torch.get_device_module(device.type).set_device(device)
            call()
        except BaseException as error:  # NOTE: re-raised in the caller's thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls[:-1]]
    for thread in threads:
        thread.start()
    try:
        if calls:
            calls[-1]()
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def storage_writer(path: str, direct: bool = False) -> FileSystemWriter:
    """DCP's file writer for `path`: DCP's own buffered files, or with `direct` through DirectWriteFileSystem."""
    writer = FileSystemWriter(path)
    if not direct:
        return writer
    # NOTE: FileSystemWriter builds its FileSystem in __init__ and offers no argument for another; every file it
    # writes goes through `self.fs.create_stream` (torch 2.11-2.15, the tested range; guarded by
    # tests/test_checkpoint.py::test_dcp_files_are_written_through_direct_io).
    writer.fs = DirectWriteFileSystem()
    return writer


class DirectWriteFileSystem(FileSystem):
    """DCP's local file system, with every file it creates written by direct_io (O_DIRECT from a background
    thread) instead of through the page cache.

    NOTE: measured on the development VM, one process saving 2.49 GB with `dcp.save`: 3.9-7.2 s with DCP's own
    buffered files, 1.6 s through this, the same bytes read back.
    """

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = DirectStream(str(path))
        try:
            yield stream
        except BaseException:
            stream.file.abort()
            raise
        stream.close()  # durable here: the tail written, the file cut to length and fsynced


def commit_checkpoint(staging: str, final: str) -> None:
    """Give the staging folder its final name once every rank has written its part.

    NOTE: collective; call on every rank. The rename is atomic, so `final` is either absent, the previous
    complete checkpoint, or the new complete one.
    """
    dist.barrier()
    if is_rank0():
        _fsync_tree(staging)
        if os.path.exists(final):
            # Saving the same step again (e.g. at the end of training): swap, then drop the old one.
            old = staging_dir(final) + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
        _fsync_dir(os.path.dirname(os.path.abspath(final)))
    dist.barrier()


def _fsync_tree(root: str) -> None:
    """Flush every file under `root` to disk before the rename makes it visible."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    """Flush a folder's entries (names created or renamed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
