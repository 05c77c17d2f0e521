"""Which checkpoint to resume from: `resume_from_checkpoint="auto"` takes the newest one in output_dir that
can be read whole, else starts fresh.

A `checkpoint-N` folder is only ever complete when it appears (staging + rename), but a disk can still
lose or cut its files afterwards (a full disk, a cleanup). Each candidate is checked without loading it:
its DCP metadata must unpickle, every file the metadata points into must exist and be long enough, its
adapter files (LoRA) must have a readable header and all their bytes, and trainer_state.json must parse.
Nothing here deletes anything. It knows the checkpoint layout, not the Trainer.
"""

from __future__ import annotations

import json
import os

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import sort_checkpoints

from ..distributed import broadcast_from_rank0, is_rank0, log_rank0, warn_rank0
from ..loading.safetensors_reader import read_header
from .adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .sharded import METADATA_FILE, MODEL_DIR, OPTIMIZER_DIR, read_metadata


def checkpoints_newest_first(output_dir: str) -> list[str]:
    """The `checkpoint-N` folders in `output_dir`, highest N first (hidden staging folders never match)."""
    return sort_checkpoints(output_dir)[::-1]


def checkpoint_problem(checkpoint: str) -> str | None:
    """Name the first file of `checkpoint` that cannot be read whole and what is wrong with it, or None."""
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    try:
        with open(state) as f:
            json.load(f)
    except (OSError, ValueError) as error:
        return f"{state}: {error}"
    dcp_folders = [os.path.join(checkpoint, d) for d in (MODEL_DIR, OPTIMIZER_DIR)]
    dcp_folders = [d for d in dcp_folders if os.path.isdir(d)]
    problems = [_dcp_problem(folder) for folder in dcp_folders] + _adapter_problems(checkpoint)
    if not dcp_folders and not os.path.isfile(os.path.join(checkpoint, ADAPTER_WEIGHTS)):
        problems.append(f"{checkpoint}: neither {MODEL_DIR}/ nor {ADAPTER_WEIGHTS}: no weights to resume from")
    return next((p for p in problems if p), None)


def _dcp_problem(folder: str) -> str | None:
    """What is wrong with a DCP folder: unreadable metadata, or a file missing or shorter than its data."""
    if not os.path.isfile(os.path.join(folder, METADATA_FILE)):
        return f"{os.path.join(folder, METADATA_FILE)}: missing"
    try:
        metadata = read_metadata(folder)
    except ValueError as error:
        return str(error)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path}: missing (the checkpoint's metadata points into it)"
        if os.path.getsize(path) < size:
            return f"{path}: truncated ({os.path.getsize(path)} bytes, the metadata needs {size})"
    return None


def _adapter_problems(checkpoint: str) -> list[str | None]:
    """What is wrong with each adapter folder (peft's files) in the checkpoint."""
    problems: list[str | None] = []
    for folder, _, files in os.walk(checkpoint):
        if ADAPTER_WEIGHTS not in files:
            continue
        path = os.path.join(folder, ADAPTER_WEIGHTS)
        try:
            header, start = read_header(path)
            end = max((entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"), default=0)
            if os.path.getsize(path) < start + end:
                problems.append(f"{path}: truncated ({os.path.getsize(path)} bytes, its header needs {start + end})")
        except (OSError, ValueError, KeyError) as error:
            problems.append(f"{path}: unreadable header ({error})")
        if ADAPTER_CONFIG not in files:
            problems.append(f"{os.path.join(folder, ADAPTER_CONFIG)}: missing")
    return problems


def find_resume_checkpoint(output_dir: str) -> str | None:
    """The newest readable checkpoint in `output_dir`, or None to start fresh; decided by rank 0 for all.

    A newer checkpoint that cannot be read is skipped with a warning naming the file and the problem.

    NOTE: collective; every rank must call it.
    """
    chosen = None
    if is_rank0():
        for checkpoint in checkpoints_newest_first(output_dir):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                chosen = checkpoint
                break
            warn_rank0("Not resuming from %s, which cannot be read: %s. Trying the one before.", checkpoint, problem)
    chosen = broadcast_from_rank0(chosen)
    if chosen is None:
        log_rank0("resume_from_checkpoint='auto': no readable checkpoint in %s; starting fresh.", output_dir)
    else:
        log_rank0("resume_from_checkpoint='auto': resuming from %s.", chosen)
    return chosen
