"""An ordinary Trainer script with one change, `Trainer` → `FSDP2Trainer`: no close_distributed(), no extra line.

argv: MODEL OUT [fail]. With `fail`, rank 1 raises after training: the job must fail fast, not hang at exit.
A handler registered before hf_fsdp2 is imported runs after its exit handler (atexit is last-in, first-out)
and reports whether the process group was really ended.
"""

import atexit
import sys

import torch.distributed as dist


def report() -> None:
    print(f"at exit: process group open {dist.is_initialized()}", flush=True)


atexit.register(report)

from transformers import AutoModelForCausalLM, TrainingArguments  # noqa: E402

from hf_fsdp2 import FSDP2Trainer  # noqa: E402
from tests.workers.train_worker import make_dataset  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
args = TrainingArguments(
    sys.argv[2], max_steps=2, per_device_train_batch_size=2, use_cpu=True, report_to=[], save_strategy="no"
)
trainer = FSDP2Trainer(model, args, train_dataset=make_dataset(16, 96))
trainer.train()
if sys.argv[3:] == ["fail"] and dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails after training")
print(f"rank {dist.get_rank()} trained", flush=True)
