"""Full fine-tuning of a causal LM on prompt/response pairs (loss on the response only), end to end:
train with sharded checkpoints → export a from_pretrained folder → reload it → evaluate → summary.

    torchrun --nproc_per_node 2 recipes/full_finetune.py recipes/configs/full_finetune.yaml

With the shipped config this is the embedded default (a tiny Llama learning to sort and reverse digits,
built on first use; nothing is downloaded). Your own model and data:
    ... full_finetune.yaml model_name_or_path=path/to/model train_file=train.jsonl eval_file=eval.jsonl
Any SFTArguments, TrainingArguments or FSDP2Config field can be set in the YAML file or as key=value.
"""

from __future__ import annotations

import sys

from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.jobs.args import parse_recipe_args
from hf_fsdp2.jobs.sft import SFTArguments, run_sft


def main() -> None:
    args, training_args, fsdp2_config = parse_recipe_args((SFTArguments, TrainingArguments, FSDP2Config), sys.argv[1:])
    run_sft(args, training_args, fsdp2_config)


if __name__ == "__main__":
    main()
