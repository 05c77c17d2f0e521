"""LoRA fine-tuning of a causal LM on prompt/response pairs with FSDP2Trainer.

    torchrun --nproc_per_node 2 recipes/lora_finetune.py recipes/configs/lora_finetune.yaml \
        model_name_or_path=path/to/model train_file=data.jsonl output_dir=out/lora max_steps=100

The YAML file sets the defaults; `key=value` or `--key value` overrides any field of the recipe,
TrainingArguments or FSDP2Config (e.g. bf16=true fsdp_activation_checkpointing=true
merge_adapters_on_save=true). The base model is read as a meta skeleton: each rank loads only its shard.
Checkpoints are adapter-only (peft's files + sharded optimizer state); at the end `output_dir` holds an
adapter folder for `PeftModel.from_pretrained(base, output_dir)`, or the merged model with
merge_adapters_on_save=true.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, TrainingArguments, set_seed

from hf_fsdp2 import FSDP2Config, FSDP2Trainer, from_pretrained
from hf_fsdp2.recipe_args import parse_recipe_args
from hf_fsdp2.sft_data import read_jsonl, sft_collator, tokenize_pairs


@dataclass
class RecipeArguments:
    """Model, data and adapter settings of this recipe."""

    model_name_or_path: str = field(metadata={"help": "Local Hugging Face model folder (config, safetensors, tokenizer)."})
    train_file: str = field(metadata={"help": "JSON lines file with prompt/response rows."})
    eval_file: Optional[str] = field(default=None, metadata={"help": "Optional JSON lines file for evaluation."})
    prompt_column: str = field(default="prompt")
    response_column: str = field(default="response")
    max_length: int = field(default=512, metadata={"help": "Longest tokenized example (prompt + response)."})
    lora_r: int = field(default=16)
    lora_alpha: int = field(default=32)
    lora_dropout: float = field(default=0.0)
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj", metadata={"help": "Comma-separated module names, or 'all-linear'."}
    )
    modules_to_save: Optional[str] = field(default=None, metadata={"help": "Comma-separated modules trained in full."})


def main() -> None:
    recipe, training_args, fsdp2_config = parse_recipe_args(
        (RecipeArguments, TrainingArguments, FSDP2Config), sys.argv[1:]
    )
    set_seed(training_args.seed)  # before the skeleton: the adapters draw from this state, as on one process
    tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
    targets = recipe.lora_target_modules
    lora = LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
        modules_to_save=recipe.modules_to_save.split(",") if recipe.modules_to_save else None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(from_pretrained(recipe.model_name_or_path), lora)
    files = {"train": recipe.train_file, **({"eval": recipe.eval_file} if recipe.eval_file else {})}
    columns = dict(prompt_column=recipe.prompt_column, response_column=recipe.response_column)
    data = {split: tokenize_pairs(read_jsonl(path), tokenizer, recipe.max_length, **columns) for split, path in files.items()}
    trainer = FSDP2Trainer(
        model,
        training_args,
        fsdp2_config=fsdp2_config,
        train_dataset=data["train"],
        eval_dataset=data.get("eval"),
        data_collator=sft_collator(tokenizer),
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if "eval" in data:
        trainer.evaluate()


if __name__ == "__main__":
    main()
