"""Shard-exact twins of optimizer classes, adopted in place: an optimizer of a class (or of a subclass of it) whose
step is not elementwise takes the twin's step, which gives it the whole rows, columns or matrices it reads.

A subclass is recognised by its MRO, whatever it is named; one that overrides `step` is refused, since its step
would either run instead of the twin's (inexact on shards) or be skipped. It knows classes, not DTensors or models.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def adopt_twin(optimizer: torch.optim.Optimizer, base: type, twin: type) -> bool:
    """Give `optimizer`, if it is a `base`, `twin`'s step in place (a scheduler built on it keeps working); True
    when it runs a twin's step now.

    Raises:
        ValueError: when a subclass of `base` overrides `step` (hf_fsdp2 cannot vouch for it on shards).
    """
    cls = type(optimizer)
    if issubclass(cls, twin) or not issubclass(cls, base):
        return issubclass(cls, twin)
    subclasses = cls.__mro__[: cls.__mro__.index(base)]
    overriding = next((c for c in subclasses if _own_step(c) not in (None, _own_step(base))), None)
    if overriding is not None:
        raise ValueError(
            f"{cls.__name__} subclasses {base.__module__}.{base.__qualname__} and {overriding.__name__} overrides "
            f"step: on FSDP2 shards hf_fsdp2 replaces {base.__name__}'s step with a shard-exact one ({twin.__name__}) "
            "and cannot vouch for yours. Keep the base class's step (override other methods), or use "
            f"{base.__name__} itself."
        )
    # NOTE: in place, not a copy: the user's LR scheduler (Trainer's `optimizers=(opt, sched)`) holds this object.
    optimizer.__class__ = twin if cls is base else type(f"Sharded{cls.__name__}", (twin, cls), {})
    return True


def _own_step(cls: type) -> Any:
    """The step `cls` defines itself (None if it inherits it), unwrapped: torch.optim.Optimizer's `__init__` wraps
    each class's step in a profiling hook (`_patch_step_function`) stored on the class, which is no override."""
    step = cls.__dict__.get("step")
    return None if step is None else inspect.unwrap(step)
