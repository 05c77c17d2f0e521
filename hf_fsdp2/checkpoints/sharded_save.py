"""Writing a sharded checkpoint: each rank's parts (model, optimizer) through DCP into a hidden staging folder,
published under its final name by an atomic rename once every rank has written its part.

A save is synchronous (both parts written at once, each in its own thread) or asynchronous (staged to host memory,
written in the background); `PartSavers` holds what saves keep between checkpoints. The layout is
`checkpoints.sharded`'s. This module knows nothing about the Trainer.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

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


class PartSavers:
    """What saves keep between checkpoints: a gloo group per part (model, optimizer) and, for asynchronous
    saves, a host-memory stager per part.

    NOTE: each part's DCP save runs its collectives in its own thread (the model's beside the optimizer's in a sync
    save, both in the background in an async one); sharing a group between them (or with training) lets them
    interleave differently on each rank and deadlock. Where torch's stager can stage again (torch 2.13) it is kept:
    it caches its host buffers, so after the first save staging is a copy, not an allocation. Where it cannot
    (torch 2.11's closes itself after staging, so its second save fails with `KeyError: <class 'type'>`), each save
    gets a fresh one; that torch dropped its buffers after every save anyway, so nothing is lost.
    """

    def __init__(self, async_save: bool = False) -> None:
        self.groups = {part: new_host_group() for part in (MODEL_DIR, OPTIMIZER_DIR)}
        self._options = StagingOptions(torch.cuda.is_available(), False, False, False)  # pinned where CUDA is
        self.reuses_stagers = async_save and stager_stages_again()
        self.stagers = {part: DefaultStager(self._options) for part in (MODEL_DIR, OPTIMIZER_DIR)} if async_save else {}

    def stager(self, part: str) -> DefaultStager:
        """The stager for `part`'s next asynchronous save: the kept one, or a fresh one where torch's cannot stage
        twice (the last save's writes are finished: the trainer waits for them before the next save)."""
        if not self.reuses_stagers:
            self.stagers[part].close()
            self.stagers[part] = DefaultStager(self._options)
        return self.stagers[part]

    def close(self) -> None:
        """Free the cached host buffers."""
        for stager in self.stagers.values():
            stager.close()


def stager_stages_again() -> bool:
    """Whether torch's `DefaultStager` can stage a second time: asked of torch itself (a few bytes, once per
    trainer) rather than read from its version, so a release that changes it again is handled as it behaves."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        stager.stage({"probe": torch.zeros(1)})
        stager.stage({"probe": torch.zeros(1)})
    except KeyError:  # torch 2.11: the first stage emptied the stager's copy table (DefaultStager._stage closes it)
        return False
    finally:
        stager.close()
    return True


def write_parts(
    directory: str, parts: list[tuple[str, dict[str, Any]]], savers: PartSavers, direct: bool = False
) -> list[Any]:
    """Write this rank's `parts` (from `sharded_parts`) under `directory`; `direct=True` writes with O_DIRECT
    (FSDP2Config.checkpoint_writes="direct").

    With stagers in `savers` (async) the state is copied to host memory now and written in the background; the
    returned futures finish when it is on disk. Otherwise the parts are written at once, each in its own thread,
    and it returns [] once both are on disk.
    """
    writers = {folder: storage_writer(os.path.join(directory, folder), direct) for folder, _ in parts}
    if savers.stagers:
        return [
            dcp.async_save(
                state,
                storage_writer=writers[folder],
                process_group=savers.groups[folder],
                async_stager=savers.stager(folder),
            )
            for folder, state in parts
        ]
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
