"""Models a trainer subclass builds from a path itself (TRL's `RewardTrainer` builds a `num_labels=1` classifier,
its trainers pass `model_init_kwargs`, DPO and KTO build their reference model): while the subclass's `__init__`
runs, `from_pretrained(path, ...)` of any transformers model class builds our meta skeleton of exactly that call
instead of reading the weights, so the model the subclass asked for is what gets sharded and each rank reads only
its slices. A call with positional arguments after the path is refused by name (the skeleton is built from keywords;
loading it as called would put the whole model on every rank).

It knows nothing of trainers: the mixin opens the window around the subclass's `__init__` and closes it around its
own loading.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from ..confined_patch import ConfinedPatch
from .skeleton import first_meta_tensor, from_pretrained, get_source

# from_pretrained arguments about device placement: sharding places the model.
PLACEMENT_KWARGS = ("device_map",)


@dataclass
class _Window:
    """One trainer's window: the skeletons built so far, and how deep our own loading (which reads) is nested."""

    built: list[nn.Module] = field(default_factory=list)
    suspended: int = 0


def _intercepting(original: classmethod) -> classmethod:
    """The from_pretrained that builds a skeleton for a path, for calls from a thread inside a window."""

    def build(cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
        window = _FROM_PRETRAINED.current()
        if window is None or window.suspended or not isinstance(path, (str, os.PathLike)):
            return original.__func__(cls, path, *args, **kwargs)
        check_no_positional(cls, path, args)
        kwargs = {k: v for k, v in kwargs.items() if k not in PLACEMENT_KWARGS}
        skeleton = from_pretrained(path, cls, **kwargs)
        window.built.append(skeleton)
        return skeleton

    return classmethod(build)


# NOTE: the one seam there is. A subclass (TRL's) turns a path into a model inside its own __init__ with
# `AutoModel*.from_pretrained(path, **its kwargs)`, and no argument or method lets us build that model on the meta
# device instead. Auto classes resolve the class and its config (with overrides such as `num_labels=1`) and call the
# concrete class's from_pretrained, which PreTrainedModel defines for every model class, so this one place sees every
# model a path becomes. Confined: on the class only while a trainer is being built, and only the building thread's
# calls are intercepted (confined_patch.py); every other call reaches transformers' own.
_FROM_PRETRAINED: ConfinedPatch[_Window] = ConfinedPatch(PreTrainedModel, "from_pretrained", _intercepting)


@contextlib.contextmanager
def skeletons_for_paths() -> Iterator[list[nn.Module]]:
    """Within the block, this thread's `from_pretrained(path, **kwargs)` builds the skeleton of that call; yields
    those built.

    Raises:
        RuntimeError: when the block opens inside another one in this thread (one trainer is built at a time).
    """
    if _FROM_PRETRAINED.current() is not None:
        raise RuntimeError("a trainer is already being built in this thread; build trainers one after another.")
    with _FROM_PRETRAINED.window(_Window()) as window:
        yield window.built


@contextlib.contextmanager
def loading_for_real() -> Iterator[None]:
    """Within the block, from_pretrained reads weights again (our own loading, the rank-0 route, calls it)."""
    window = _FROM_PRETRAINED.current()
    if window is None:
        yield
        return
    window.suspended += 1
    try:
        yield
    finally:
        window.suspended -= 1


def check_no_positional(cls: type, path: Any, args: tuple[Any, ...]) -> None:
    """Refuse positional arguments after the path: the skeleton is built from keywords, and handing the call to
    transformers instead would load the whole model on every rank without a word.

    Raises:
        ValueError: naming the class, the path and how many positional arguments came, with the two fixes.
    """
    if args:
        raise ValueError(
            f"{cls.__name__}.from_pretrained({os.fspath(path)!r}, ...) was called with {len(args)} positional "
            "argument(s) after the path while the trainer was being built. hf_fsdp2 builds a path's model as a meta "
            "skeleton that each rank fills with its own slices, from keyword arguments only; loading it as called "
            "would put the whole model on every rank. Pass those arguments by keyword (from_pretrained hands "
            "keywords that are not config fields to the model's __init__), or load the model yourself and pass "
            "the object to the trainer (rank 0's weights are then sent to the others)."
        )


def check_all_sharded(built: list[nn.Module]) -> None:
    """Every skeleton the subclass built got its weights (it handed it, or a PEFT model around it, to Trainer or to
    `accelerator.prepare_model`, which shard and load it).

    Raises:
        RuntimeError: naming the class and path of a skeleton that would stay without weights.
    """
    for skeleton in built:
        if first_meta_tensor(skeleton) is not None:
            source = get_source(skeleton)
            raise RuntimeError(
                f"the trainer built {type(skeleton).__name__} from {source.path if source else 'a path'} in its "
                "__init__ but never handed it to Trainer or accelerator.prepare_model, so hf_fsdp2 never loaded its "
                "weights. Pass that model to the trainer as an object (loaded with from_pretrained) instead of a path."
            )
