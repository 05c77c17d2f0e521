"""hf_fsdp2: shard any Hugging Face model with PyTorch FSDP2 by changing `Trainer(...)` to `FSDP2Trainer(...)`.

Read the code in flow order, a room (subpackage) at a time: loading → sharding → model → trainer → checkpoints →
export; adapters, long_rows, optim and planning serve them (docs/how-it-works.md walks them).

The public names below are imported on first use (PEP 562), so a process that needs only part of the package
(the `hf-fsdp2 consolidate` command) does not import transformers' Trainer, modeling code and peft: importing all
of them took ~7 s on a 2-core machine, more than `accelerate merge-weights` needs in all. No public name is also the
name of a submodule, because importing a submodule binds its name on the package.
"""

import importlib
import logging
from typing import TYPE_CHECKING, Any

from transformers.utils import logging as transformers_logging

from .distributed import start_restarted_worker
from .versions import check_versions_once

if TYPE_CHECKING:
    from .checkpoints.disk_space import CheckpointDiskFull, CheckpointWriteError
    from .config import FSDP2Config
    from .distributed import close_distributed
    from .export.consolidation import consolidate
    from .loading.skeleton import from_pretrained
    from .model import prepare_model
    from .optim.muon import MuonAdamW
    from .optim.muon_routing import Muon
    from .planning.memory_plan import plan
    from .sharding.gathering import gathered
    from .trainer.callbacks import ConsolidateCallback
    from .trainer.mixin import FSDP2Mixin, FSDP2Trainer

# Each public name and the submodule that defines it.
_EXPORTS = {
    "CheckpointDiskFull": "checkpoints.disk_space",
    "CheckpointWriteError": "checkpoints.disk_space",
    "ConsolidateCallback": "trainer.callbacks",
    "FSDP2Config": "config",
    "FSDP2Mixin": "trainer.mixin",
    "FSDP2Trainer": "trainer.mixin",
    "Muon": "optim.muon_routing",
    "MuonAdamW": "optim.muon",
    "close_distributed": "distributed",
    "consolidate": "export.consolidation",
    "from_pretrained": "loading.skeleton",
    "gathered": "sharding.gathering",
    "plan": "planning.memory_plan",
    "prepare_model": "model",
}
__all__ = [
    "CheckpointDiskFull",
    "CheckpointWriteError",
    "ConsolidateCallback",
    "FSDP2Config",
    "FSDP2Mixin",
    "FSDP2Trainer",
    "Muon",
    "MuonAdamW",
    "close_distributed",
    "consolidate",
    "from_pretrained",
    "gathered",
    "plan",
    "prepare_model",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's submodule the first time the name is used."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # NOTE: checked at first use, not at `import hf_fsdp2`, so that `hf-fsdp2 env` can still report the versions it
    # would refuse; `from hf_fsdp2 import FSDP2Trainer` is the first use and fails here, in one line.
    check_versions_once()
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    """The public names too, before their first use (`dir()`, tab completion)."""
    return sorted(set(globals()) | set(_EXPORTS))


# Our loggers sit under transformers' library logger (its handler, its level), so Trainer's
# `log_level`/`log_level_replica` and `transformers.logging.set_verbosity_*` govern hf_fsdp2's messages exactly
# as they govern Trainer's: INFO lines appear with log_level="info" and not at the default (warning).
logging.getLogger(__name__).parent = transformers_logging.get_logger()

# A torchrun worker restarted after a failure must join its new group before TrainingArguments does.
start_restarted_worker()
