"""A run started with `Trainer` + Accelerate's FSDP2 plugin (SHARDED_STATE_DICT checkpoints), finished by
FSDP2Trainer from one of its checkpoints, against the same run left uninterrupted.

Usage: accelerate_resume_worker.py MODEL OUT [lora] [full_state]. Both phases in one process group: first
Trainer + Accelerate (FSDP2 forced on this CPU machine exactly where Accelerate would install it on a GPU, as the
benchmark harness does) trains 4 steps saving every 2; then FSDP2Trainer resumes its checkpoint-2 in another output
dir and trains to step 4. With `lora` both train a LoRA adapter (Accelerate keeps it inside its sharded model
state); with `full_state` Accelerate saves FULL_STATE_DICT checkpoints (pytorch_model_fsdp.bin, optimizer.bin)
instead of sharded ones. Rank 0 writes OUT/result.json: both loss curves and the largest weight difference.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, TrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "benchmark"))
from benchmark_systems import AccelerateFSDP2Trainer  # noqa: E402

from hf_fsdp2 import FSDP2Config, FSDP2Trainer  # noqa: E402
from tests.workers.scenarios import PARITY_ADAM_EPSILON, losses  # noqa: E402
from tests.workers.train_worker import make_dataset  # noqa: E402

MODEL, OUT = sys.argv[1:3]
LORA = "lora" in sys.argv[3:]
STATE_DICT_TYPE = "FULL_STATE_DICT" if "full_state" in sys.argv[3:] else "SHARDED_STATE_DICT"


def model() -> object:
    """The model both runs start from (the same LoRA adapter config for both when `lora`)."""
    base = AutoModelForCausalLM.from_pretrained(MODEL)
    if not LORA:
        return base
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def arguments(output_dir: str, **fsdp: object) -> TrainingArguments:
    return TrainingArguments(
        output_dir, max_steps=4, save_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
        adam_epsilon=PARITY_ADAM_EPSILON, lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=3,
        disable_tqdm=True, use_cpu=True, **fsdp,
    )  # fmt: skip


def full_state(model) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main() -> None:
    accelerate_dir, ours_dir = os.path.join(OUT, "accelerate"), os.path.join(OUT, "ours")
    fsdp_config = {
        "version": 2,
        "state_dict_type": STATE_DICT_TYPE,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True,
    }
    theirs = AccelerateFSDP2Trainer(
        model=model(),
        args=arguments(accelerate_dir, fsdp=True, fsdp_config=fsdp_config),
        train_dataset=make_dataset(32, 96),
    )
    theirs.train()
    reference = full_state(theirs.model)
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(accelerate_dir, "checkpoint-2"), os.path.join(ours_dir, "checkpoint-2"))
    dist.barrier()
    ours = FSDP2Trainer(
        model() if LORA else MODEL,
        arguments(ours_dir),
        fsdp2_config=FSDP2Config(consolidate_on_train_end=False),
        train_dataset=make_dataset(32, 96),
    )
    ours.train(resume_from_checkpoint=os.path.join(ours_dir, "checkpoint-2"))
    resumed = full_state(ours.model)
    if dist.get_rank() == 0:
        diff = max((resumed[k].float() - reference[k].float()).abs().max().item() for k in reference)
        with open(os.path.join(OUT, "result.json"), "w") as f:
            json.dump({"accelerate": losses(theirs), "ours": losses(ours), "max_weight_diff": diff}, f)


if __name__ == "__main__":
    main()
