"""FSDP2Trainer and FSDP2Mixin: the Trainer hooks, in mixins that each own their state.

`from hf_fsdp2.trainer import FSDP2Trainer` (hf_fsdp2 0.1's path) keeps working; the names are imported on first use,
so importing one of this room's light modules (preemption, callbacks) does not import the whole Trainer stack.
"""

from __future__ import annotations

from typing import Any

_MIXIN_NAMES = ("FSDP2Mixin", "FSDP2Trainer")


def __getattr__(name: str) -> Any:
    """FSDP2Trainer and FSDP2Mixin from `trainer.mixin`, on first use."""
    if name not in _MIXIN_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import mixin

    return getattr(mixin, name)
