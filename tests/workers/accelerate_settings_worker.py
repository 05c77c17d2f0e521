"""A Trainer script written for Accelerate's FSDP2 plugin, with `Trainer` swapped for `FSDP2Trainer`.

Usage: accelerate_settings_worker.py MODE MODEL OUT, MODE one of
- plain: plain `Trainer` in one process (the reference losses);
- fsdp_config: `TrainingArguments(fsdp=True, fsdp_config={...})` as such a user has it;
- launch: plain `TrainingArguments`, the FSDP settings coming from `accelerate launch --use_fsdp ...` flags;
- ours: the same settings written as `FSDP2Config` (what the carried ones must equal).
Rank 0 writes OUT/MODE.json: losses, weights, the resolved FSDP2Config and which units checkpoint activations.
"""

from __future__ import annotations

import json
import os
import sys

from torch.distributed._composable.contract import _get_registry
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from tests.workers.scenarios import PARITY_ADAM_EPSILON, full_weights, losses
from tests.workers.train_worker import make_dataset

MODE, MODEL, OUT = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
FSDP_CONFIG = {
    "version": 2,
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "activation_checkpointing": True,
    "reshard_after_forward": False,
    "state_dict_type": "SHARDED_STATE_DICT",
    "cpu_ram_efficient_loading": True,
}


def main() -> None:
    fsdp = dict(fsdp=True, fsdp_config=FSDP_CONFIG) if MODE == "fsdp_config" else {}
    args = TrainingArguments(
        os.path.join(OUT, MODE), max_steps=4, per_device_train_batch_size=4 // WORLD, learning_rate=1e-2,
        adam_epsilon=PARITY_ADAM_EPSILON, lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=3,
        disable_tqdm=True, use_cpu=True, save_strategy="no", **fsdp,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    if MODE == "plain":
        trainer = Trainer(model=model, args=args, train_dataset=make_dataset(32, 96))
    else:
        from hf_fsdp2 import FSDP2Config, FSDP2Trainer

        ours = FSDP2Config(fsdp_activation_checkpointing=True, reshard_after_forward=False) if MODE == "ours" else None
        trainer = FSDP2Trainer(model=model, args=args, train_dataset=make_dataset(32, 96), fsdp2_config=ours)
    trainer.train()
    result = {"losses": losses(trainer), "weights": full_weights(trainer.model)}
    if MODE != "plain":
        config = trainer.fsdp2_config
        result["config"] = {k: getattr(config, k) for k in ("fsdp_activation_checkpointing", "reshard_after_forward")}
        modules = trainer.model.named_modules()
        result["checkpointed"] = [n for n, m in modules if "checkpoint" in (_get_registry(m) or {})]
        # Nothing may checkpoint the blocks a second time (Trainer or Accelerate wrapping them too).
        result["wrappers"] = [n for n, m in trainer.model.named_modules() if "CheckpointWrapper" in type(m).__name__]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(OUT, f"{MODE}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
