"""Sharded checkpoints on disk: their layout, and reading them in place (torch DCP).

Layout, compatible with Trainer + Accelerate's sharded FSDP checkpoints (so `accelerate merge-weights`
and `get_last_checkpoint` work on ours):
    checkpoint-N/pytorch_model_fsdp_0/   DCP, state under "model" (tied weights stored once)
    checkpoint-N/optimizer_0/            DCP, state under "optimizer"
A checkpoint is written under a hidden staging name and renamed once every rank has finished, so a folder
named checkpoint-N is always complete: writing it is `checkpoints.sharded_save`'s, reading it back into a live
model and optimizer `checkpoints.sharded_resume`'s. This module knows nothing about the Trainer.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ..distributed import raise_if_any_rank
from ..loading.facts import facts_of
from .distcp_reader import SafeFileSystemReader

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
        # Trainer's own words first: scripts and tests match "Can't find a valid checkpoint at".
        raise ValueError(
            f"Can't find a valid checkpoint at {checkpoint}: it is not a directory; pass a checkpoint-N folder or its "
            f"{MODEL_DIR}."
        )
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
