"""LoRA fine-tuning of a causal LM on prompt/response pairs with FSDP2Trainer, end to end: train with
adapter-only checkpoints → export the adapter (or the merged model) → reload it → evaluate → summary.

    torchrun --nproc_per_node 2 recipes/lora_finetune.py recipes/configs/lora_finetune.yaml

With the shipped config this runs on the embedded default. Your own model and data:
    ... lora_finetune.yaml model_name_or_path=path/to/model train_file=data.jsonl eval_file=eval.jsonl
Any SFTArguments, LoraArguments, TrainingArguments or FSDP2Config field can be set in the YAML file or
overridden as key=value (e.g. lora_r=8 bf16=true merge_adapters_on_save=true). The base model is read as
a meta skeleton: each rank loads only its shard. At the end `output_dir` holds an adapter folder for
`PeftModel.from_pretrained(base, output_dir)`, or the merged model with merge_adapters_on_save=true.
"""

from __future__ import annotations

import sys

from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.jobs.args import parse_recipe_args
from hf_fsdp2.jobs.sft import LoraArguments, SFTArguments, run_sft


def main() -> None:
    args, lora, training_args, fsdp2_config = parse_recipe_args(
        (SFTArguments, LoraArguments, TrainingArguments, FSDP2Config), sys.argv[1:]
    )
    run_sft(args, training_args, fsdp2_config, lora=lora)


if __name__ == "__main__":
    main()
