"""Resuming from a checkpoint Trainer + Accelerate's FSDP plugin wrote with `state_dict_type=FULL_STATE_DICT`:
`pytorch_model_fsdp.bin` (the full model state, or a PEFT model's adapter) and `optimizer.bin` (the full
optimizer state), each a `torch.save` of plain tensors under the parameters' names.

Every rank memory-maps the files (`weights_only=True`) and copies out its own shard of each tensor, so pages
of other ranks' rows are never read into memory. What hf_fsdp2 writes itself is always sharded (`checkpoint`);
this module only reads. Knows nothing about the Trainer.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from ..loading.weights import copy_full_into, shape_mismatch

FULL_MODEL_FILE = "pytorch_model_fsdp.bin"
FULL_OPTIMIZER_FILE = "optimizer.bin"


def has_full_model_state(checkpoint: str) -> bool:
    """True for a FULL_STATE_DICT checkpoint of Trainer + Accelerate."""
    return os.path.isfile(os.path.join(checkpoint, FULL_MODEL_FILE))


def has_full_optimizer_state(checkpoint: str) -> bool:
    """True when the optimizer was saved whole (FULL_STATE_DICT)."""
    return os.path.isfile(os.path.join(checkpoint, FULL_OPTIMIZER_FILE))


def _load(path: str) -> dict:
    """A torch.save'd state, memory-mapped: only the pages a rank copies from are read."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_full_model_state(state: dict[str, torch.Tensor], checkpoint: str) -> None:
    """Fill the sharded tensors of `state` (the model's own state, tied weights once) from the full file.

    Raises:
        ValueError: when the file lacks one of the model's tensors or holds it with another shape.
    """
    path = os.path.join(checkpoint, FULL_MODEL_FILE)
    stored = _load(path)
    missing = sorted(set(state) - set(stored))
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} of this model's tensors (e.g. {missing[:3]}): it was saved from another "
            "model (or, for LoRA, holds only the adapter: resume it with the same PEFT model)."
        )
    mismatch = shape_mismatch(stored, state)
    if mismatch is not None:
        name, saved, wanted = mismatch
        raise ValueError(f"{name} has shape {saved} in {path} but {wanted} in the model.")
    for name, tensor in state.items():
        copy_full_into(tensor, stored[name])


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str) -> None:
    """Set the optimizer's state from the full `optimizer.bin`; torch shards each tensor like its parameter."""
    full = _load(os.path.join(checkpoint, FULL_OPTIMIZER_FILE))
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
