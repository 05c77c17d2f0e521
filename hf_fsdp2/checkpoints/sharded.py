"""Sharded checkpoints on disk: every rank writes and reads only its own part (torch DCP).

Layout, compatible with Trainer + Accelerate's sharded FSDP checkpoints (so `accelerate merge-weights`
and `get_last_checkpoint` work on ours):
    checkpoint-N/pytorch_model_fsdp_0/   DCP, state under "model" (tied weights stored once)
    checkpoint-N/optimizer_0/            DCP, state under "optimizer"
A checkpoint is written under a hidden staging name and renamed once every rank has finished, so a folder
named checkpoint-N is always complete. This module knows nothing about the Trainer.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import threading
import warnings
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
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ..distributed import get_device, is_rank0, new_host_group, raise_if_any_rank
from ..loading.facts import facts_of
from ..sharding.units import reshard_all
from .direct_io import DirectStream
from .distcp_reader import SafeFileSystemReader
from .full_state import (
    has_full_model_state,
    has_full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)

MODEL_DIR = "pytorch_model_fsdp_0"
OPTIMIZER_DIR = "optimizer_0"
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
METADATA_FILE = ".metadata"


def staging_dir(final: str) -> str:
    """The hidden name a folder is written under until complete (`get_last_checkpoint`, rotation and
    `from_pretrained` never see it)."""
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}.incomplete")


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


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model state to save or load into, with each tied weight once (under its first name)."""
    state = get_model_state_dict(model)
    for names in facts_of(model).tie_groups:
        for duplicate in names[1:]:
            state.pop(duplicate, None)
    return state


def model_dir(checkpoint: str) -> str:
    """Return the folder holding the model's DCP files: `checkpoint-N/pytorch_model_fsdp_0` or itself."""
    if os.path.isfile(os.path.join(checkpoint, METADATA_FILE)):
        return checkpoint
    return os.path.join(checkpoint, MODEL_DIR)


def validate_checkpoint(checkpoint: str) -> str:
    """Return the model DCP folder of `checkpoint`, or raise ValueError saying what is wrong with it.

    Raises:
        ValueError: when `checkpoint` is not a directory, is adapter-only, or has no complete model folder.
    """
    if not os.path.isdir(checkpoint):
        raise ValueError(f"{checkpoint} is not a directory; pass a checkpoint-N folder or its {MODEL_DIR}.")
    directory = model_dir(checkpoint)
    if not os.path.isdir(directory) and os.path.isfile(os.path.join(checkpoint, "adapter_model.safetensors")):
        raise ValueError(
            f"{checkpoint} is an adapter-only (PEFT) checkpoint: it holds no base weights. Load it with "
            "PeftModel.from_pretrained(base_model, folder), or train with FSDP2Config(merge_adapters_on_save=True) "
            "to export a merged full model."
        )
    if not os.path.isdir(directory):
        found = sorted(os.listdir(checkpoint))[:10]
        raise ValueError(
            f"{checkpoint} is not a sharded checkpoint: it has no {MODEL_DIR}/ (found {found}). Pass a "
            "checkpoint-N folder written by FSDP2Trainer or by Trainer + Accelerate with SHARDED_STATE_DICT."
        )
    if not os.path.isfile(os.path.join(directory, METADATA_FILE)):
        raise ValueError(
            f"{directory} has no {METADATA_FILE}: the checkpoint is incomplete or corrupted (its save did not "
            "finish). Use an earlier checkpoint."
        )
    return directory


def read_metadata(directory: str) -> Metadata:
    """Read a DCP folder's metadata safely.

    Raises:
        ValueError: when the metadata file is truncated or corrupt, or names a class outside the allowlist.
    """
    try:
        return SafeFileSystemReader(directory).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as error:
        # NOTE: garbage in the file surfaces as whatever the unpickler trips on (e.g. "invalid literal for
        # int()"), so every parse failure is reported as what it is: an unreadable metadata file.
        raise ValueError(
            f"{directory}/{METADATA_FILE} is not valid DCP metadata (truncated or corrupted): "
            f"{type(error).__name__}: {error}"
        ) from error


def check_compatible(metadata: Metadata, state: dict[str, torch.Tensor], prefix: str) -> None:
    """Raise ValueError naming the first tensor the checkpoint lacks or holds with another shape.

    Raises:
        ValueError: when the checkpoint lacks a tensor of `state` or holds it with another shape.
    """
    stored = metadata.state_dict_metadata
    for name, tensor in state.items():
        key = f"{prefix}.{name}"
        if key not in stored:
            raise ValueError(
                f"the checkpoint has no {name}: it was saved from another model (first stored keys: "
                f"{sorted(stored)[:3]})."
            )
        size = getattr(stored[key], "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise ValueError(
                f"{name} has shape {tuple(size)} in the checkpoint but {tuple(tensor.shape)} in the model: "
                "the checkpoint was saved from another model or config."
            )


def begin_checkpoint(final: str) -> str:
    """Create a fresh staging folder for `final` (dropping a stale one a crash left behind)."""
    staging = staging_dir(final)
    if is_rank0():
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    return staging


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
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def resume_model(model: nn.Module, checkpoint: str) -> None:
    """Fill the sharded model in place from a checkpoint (any world size: DCP reshards); also from a
    FULL_STATE_DICT checkpoint of Trainer + Accelerate (`checkpoints.full_state`)."""
    if not os.path.isdir(model_dir(checkpoint)) and has_full_model_state(checkpoint):
        load_full_model_state(model_state_dict(model), checkpoint)
        return
    directory = validate_checkpoint(checkpoint)
    state = model_state_dict(model)
    check_compatible(read_metadata(directory), state, MODEL_KEY)
    load_in_place({MODEL_KEY: state}, directory)


def resume_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str) -> None:
    """Restore the optimizer state of the sharded parameters from a checkpoint.

    Raises:
        ValueError: when `checkpoint` has no complete optimizer_0 folder or its files cannot be read.
    """
    reshard_all(model)  # the optimizer's parameters are the sharded ones (see sharded_parts)
    directory = os.path.join(checkpoint, OPTIMIZER_DIR)
    if not os.path.isdir(directory) and has_full_optimizer_state(checkpoint):
        load_full_optimizer_state(model, optimizer, checkpoint)
        return
    if not os.path.isfile(os.path.join(directory, METADATA_FILE)):
        raise ValueError(
            f"{checkpoint} has no complete {OPTIMIZER_DIR}/ to resume the optimizer from (saved with "
            "save_only_model=True?). Resume from a full checkpoint, or load only the weights."
        )
    metadata = read_metadata(directory)
    if not has_tensor_state(metadata):
        # NOTE: a stateless optimizer (plain SGD) saved only its hyperparameters. torch's get/set of the optimizer
        # state dict would each run a zero-gradient step to create state (a gradient the size of every shard,
        # then an update of every parameter): profiled at 1.2B on 2 ranks, 4.2 s of a 6.9 s resume.
        restore_param_groups(optimizer, directory, metadata)
        return
    allocate_optimizer_state(model, optimizer, metadata)
    state = get_optimizer_state_dict(model, optimizer)
    load_in_place({OPTIMIZER_KEY: state}, directory)
    _check_unloaded_state_was_never_saved(model, state, metadata, directory)
    # NOTE: not strict: a trainable parameter that never received a gradient (BERT's pooler under a
    # SentenceTransformer's mean pooling) has no Adam state in the checkpoint, as in torch's own optimizer state dict,
    # and torch's strict check refused to resume such a model (tests/test_sentence_transformers.py).
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(strict=False))


def _check_unloaded_state_was_never_saved(
    model: nn.Module, state: dict[str, Any], metadata: Metadata, directory: str
) -> None:
    """Every trainable parameter left without optimizer state has none in the checkpoint either.

    Raises:
        RuntimeError: naming a parameter whose saved state was not read.
    """
    prefix = f"{OPTIMIZER_KEY}.state."
    saved = {key[len(prefix) :].rpartition(".")[0] for key in metadata.state_dict_metadata if key.startswith(prefix)}
    for name, param in model.named_parameters():
        if param.requires_grad and name not in state["state"] and name in saved:
            raise RuntimeError(f"the optimizer state of {name} in {directory} was not read; resume it again.")


def allocate_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata) -> None:
    """Give each parameter the state tensors the checkpoint holds for it, allocated and not yet filled (DCP reads
    over them next); nothing changes when the optimizer already has state or the checkpoint holds state this
    cannot allocate (torch then creates it, as before).

    NOTE: torch's get_optimizer_state_dict creates missing state by giving every parameter a zero gradient and
    taking an optimizer step; profiled at 400M on 2 ranks (AdamW), 1.30 of a 1.87 s optimizer resume: a gradient
    and two zeroed moments per shard, then the update, all overwritten or dropped right after.
    """
    if optimizer.state:
        return
    params: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        params.setdefault(name, param)
    trained = {id(param) for group in optimizer.param_groups for param in group["params"]}
    prefix = f"{OPTIMIZER_KEY}.state."
    planned: list[tuple[torch.Tensor, str, torch.Tensor]] = []
    for key, stored in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, _, name = key[len(prefix) :].rpartition(".")
        param = params.get(fqn)
        if param is None or id(param) not in trained or not isinstance(stored, TensorStorageMetadata):
            return
        if tuple(stored.size) == tuple(param.shape):  # a per-element state (Adam's moments), sharded as the param
            value = torch.empty_like(param, dtype=stored.properties.dtype)
        elif len(stored.size) == 0:  # a scalar (Adam's step); load_state_dict moves it where the optimizer wants
            value = torch.zeros((), dtype=stored.properties.dtype)
        else:
            return
        planned.append((param, name, value))
    for param, name, value in planned:
        optimizer.state[param][name] = value


def has_tensor_state(metadata: Metadata) -> bool:
    """Whether an optimizer checkpoint holds any per-parameter state (Adam's moments; none for plain SGD)."""
    return any(key.startswith(f"{OPTIMIZER_KEY}.state.") for key in metadata.state_dict_metadata)


def restore_param_groups(optimizer: torch.optim.Optimizer, directory: str, metadata: Metadata) -> None:
    """Set each parameter group's hyperparameters (lr, momentum, ...) from a checkpoint that holds nothing else.

    Raises:
        ValueError: when the checkpoint's groups differ in number or size from the optimizer's.
    """
    prefix = f"{OPTIMIZER_KEY}.param_groups."
    groups: dict[str, Any] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            index, _, name = key[len(prefix) :].partition(".")
            groups.setdefault(index, {})[name] = None
    saved = [groups[str(i)] for i in range(len(groups))]
    load_in_place({OPTIMIZER_KEY: {"param_groups": saved}}, directory)
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if [len(group.get("params") or ()) for group in saved] != sizes:
        raise ValueError(
            f"the optimizer in {directory} has parameter groups of sizes "
            f"{[len(group.get('params') or ()) for group in saved]}, this optimizer {sizes}: it was built for "
            "other parameters. Resume with the same model and optimizer settings."
        )
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update({name: value for name, value in values.items() if name != "params"})


def load_in_place(
    state: dict[str, Any], directory: str, reader: SafeFileSystemReader | None = None, collective: bool = True
) -> None:
    """DCP-load into `state`'s tensors, turning any read failure into an error that names the folder.

    Each rank plans its own reads (no_dist): the checkpoint's metadata says where every block lies, so DCP's
    global planning (two object gathers) added only waiting. `collective`: every rank calls this together, and a
    failure on any rank is raised on all of them (so none waits for a failed one); else a local read.

    Raises:
        ValueError: when reading from `directory` fails (a corrupted, truncated or missing .distcp file).
    """
    reader = reader if reader is not None else SafeFileSystemReader(directory)
    problem = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException.
        problem = (
            f"could not read the checkpoint in {directory}: it is corrupted (a truncated or missing .distcp "
            f"file?). Use an earlier checkpoint. Details: {error}"
        )
    if collective and dist.is_initialized():
        raise_if_any_rank(problem)
    elif problem:
        raise ValueError(problem)
