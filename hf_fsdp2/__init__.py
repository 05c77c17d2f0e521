"""hf_fsdp2: shard any Hugging Face model with PyTorch FSDP2 by changing `Trainer(...)` to `FSDP2Trainer(...)`.

Read the code in flow order: distributed → skeleton → loading → sharding → model → trainer (FSDP2Mixin) → trl.
"""

from .callbacks import ConsolidateCallback
from .config import FSDP2Config
from .consolidate import consolidate
from .distributed import close_distributed, start_restarted_worker
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
    "plan",
    "prepare_model",
]
__version__ = "0.1.0"

# A torchrun worker restarted after a failure must join its new group before TrainingArguments does.
start_restarted_worker()
