"""hf_fsdp2: shard any Hugging Face model with PyTorch FSDP2 by changing `Trainer(...)` to `FSDP2Trainer(...)`.

Read the code in flow order: distributed → skeleton → loading → sharding → model → trainer (FSDP2Mixin) → trl.
"""

import logging
import os

import torch

if not torch.cuda.is_available():
    # torchao (the optional 'qlora' extra, imported by transformers and peft when installed) tries to load its CUDA
    # kernels and prints a failure per library on a machine without CUDA; NF4 needs none of them.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from transformers.utils import logging as transformers_logging  # noqa: E402

from .callbacks import ConsolidateCallback  # noqa: E402
from .config import FSDP2Config
from .consolidate import consolidate
from .distributed import close_distributed, start_restarted_worker
from .gathered import gathered
from .memory_plan import plan
from .model import prepare_model
from .skeleton import from_pretrained
from .trainer import FSDP2Mixin, FSDP2Trainer

__all__ = [
    "ConsolidateCallback",
    "FSDP2Config",
    "FSDP2Mixin",
    "FSDP2Trainer",
    "close_distributed",
    "consolidate",
    "from_pretrained",
    "gathered",
    "plan",
    "prepare_model",
]
__version__ = "0.1.0"

# Our loggers sit under transformers' library logger (its handler, its level), so Trainer's
# `log_level`/`log_level_replica` and `transformers.logging.set_verbosity_*` govern hf_fsdp2's messages exactly
# as they govern Trainer's: INFO lines appear with log_level="info" and not at the default (warning).
logging.getLogger(__name__).parent = transformers_logging.get_logger()

# A torchrun worker restarted after a failure must join its new group before TrainingArguments does.
start_restarted_worker()
