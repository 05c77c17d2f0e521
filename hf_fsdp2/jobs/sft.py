"""The supervised fine-tuning job behind the recipes, read top to bottom:
data → model (+ LoRA) → evaluate before → train (sharded checkpoints) → export → reload the export with
`from_pretrained` → evaluate after → plot and summary.

With `model_name_or_path="demo"` it runs the embedded default (hf_fsdp2.jobs.demo_task), built on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, TrainingArguments, set_seed

from ..config import FSDP2Config
from ..distributed import init_distributed, is_rank0
from ..loading.skeleton import from_pretrained
from ..trainer.mixin import FSDP2Trainer
from .args import require_eval_file
from .demo_task import EXACT_MATCH_PATH, build_demo
from .jsonl import read_jsonl
from .outputs import peak_memory_per_rank, render_summary, write_outputs
from .sft_data import prepare_for_packing, sft_collator, tokenize_pairs

DEMO = "demo"


@dataclass
class SFTArguments:
    """Model and data of a fine-tuning job (recipes add TrainingArguments and FSDP2Config beside it)."""

    model_name_or_path: str = field(
        default=DEMO, metadata={"help": "Local model folder, or 'demo' for the embedded default (built on first use)."}
    )
    train_file: str | None = field(default=None, metadata={"help": "JSON lines with prompt/response rows."})
    eval_file: str | None = field(default=None, metadata={"help": "JSON lines for eval loss and exact match."})
    demo_dir: str = field(default="out/demo", metadata={"help": "Where the embedded default is built."})
    demo_size: str = field(
        default="tiny",
        metadata={"help": "The embedded model: 'tiny' (hidden 64) or 'qlora' (hidden 256: every projection NF4)."},
    )
    prompt_column: str = field(default="prompt")
    response_column: str = field(default="response")
    max_length: int = field(default=512, metadata={"help": "Longest tokenized example (prompt + response)."})
    packing: bool = field(
        default=False,
        metadata={
            "help": "Concatenate each batch's examples into one row (no padding; position ids restart per example)."
        },
    )
    eval_generations: int = field(default=200, metadata={"help": "Eval prompts to generate for exact match (0: none)."})
    max_new_tokens: int = field(default=32, metadata={"help": "Generation length cap for exact match."})
    show_generations: int = field(default=3, metadata={"help": "Generations printed in the summary."})


@dataclass
class LoraArguments:
    """The LoRA adapter of `recipes/lora_finetune.py`."""

    lora_r: int = field(default=16)
    lora_alpha: int = field(default=32)
    lora_dropout: float = field(default=0.0)
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj", metadata={"help": "Comma-separated module names, or 'all-linear'."}
    )
    modules_to_save: str | None = field(default=None, metadata={"help": "Comma-separated modules trained in full."})

    def to_peft(self) -> Any:
        """The peft LoraConfig these arguments describe."""
        from peft import LoraConfig

        targets = self.lora_target_modules
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=targets if targets == "all-linear" else targets.split(","),
            modules_to_save=self.modules_to_save.split(",") if self.modules_to_save else None,
            task_type="CAUSAL_LM",
        )


def resolve_demo(args: SFTArguments) -> SFTArguments:
    """Build the embedded default on rank 0 (once) and point the arguments at it."""
    if args.model_name_or_path != DEMO:
        if args.train_file is None:
            raise ValueError("train_file is required with your own model (model_name_or_path != 'demo').")
        return args
    if is_rank0():
        build_demo(args.demo_dir, size=args.demo_size)
    dist.barrier()
    paths = build_demo(args.demo_dir, size=args.demo_size)  # only returns the paths now that they exist
    return replace(
        args,
        model_name_or_path=paths["model"],
        train_file=args.train_file or paths["train"],
        eval_file=args.eval_file or paths["eval"],
    )


def run_sft(
    args: SFTArguments,
    training_args: TrainingArguments,
    fsdp2_config: FSDP2Config,
    lora: LoraArguments | None = None,
) -> dict[str, Any]:
    """Run the whole job; return (and on rank 0 print and save) its summary."""
    init_distributed()
    args = resolve_demo(args)
    require_eval_file(args.eval_file, training_args.eval_strategy)
    set_seed(training_args.seed)  # before the skeleton: new weights and adapters draw as on one process
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = from_pretrained(args.model_name_or_path)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora.to_peft())
    if args.packing:
        prepare_for_packing(model)
    columns = dict(prompt_column=args.prompt_column, response_column=args.response_column)
    train = tokenize_pairs(read_jsonl(args.train_file), tokenizer, args.max_length, **columns)
    eval_rows = read_jsonl(args.eval_file) if args.eval_file else None
    trainer = FSDP2Trainer(
        model,
        training_args,
        fsdp2_config=fsdp2_config,
        train_dataset=train,
        eval_dataset=tokenize_pairs(eval_rows, tokenizer, args.max_length, **columns) if eval_rows else None,
        data_collator=sft_collator(tokenizer, packing=args.packing),
        processing_class=tokenizer,
    )
    summary: dict[str, Any] = {"before": evaluate_job(trainer, tokenizer, eval_rows, args)}
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    summary["after"] = evaluate_job(trainer, tokenizer, eval_rows, args)
    summary["exported_to"] = training_args.output_dir
    if is_rank0() and eval_rows is not None and fsdp2_config.consolidate_on_train_end:
        reloaded = load_export(training_args.output_dir, args.model_name_or_path, lora is not None)
        summary["reloaded"] = exact_match(reloaded, tokenizer, eval_rows, args, desc="Reloaded export")
    summary["peak_memory_mib_per_rank"] = peak_memory_per_rank()
    if is_rank0():
        finish(summary, trainer, training_args.output_dir)
    return summary


def evaluate_job(
    trainer: FSDP2Trainer, tokenizer: PreTrainedTokenizerBase, rows: Any | None, args: SFTArguments
) -> dict[str, Any]:
    """Eval loss and generation exact match of the sharded model (every rank takes part)."""
    if rows is None:
        return {}
    result = {"eval_loss": trainer.evaluate()["eval_loss"]}
    result.update(exact_match(trainer.model, tokenizer, rows, args, desc="Generating"))
    return result


def exact_match(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, rows: Any, args: SFTArguments, desc: str
) -> dict[str, Any]:
    """Generate greedy answers for the first `eval_generations` prompts and score them with `evaluate`."""
    import evaluate

    rows = rows.select(range(min(args.eval_generations, len(rows))))
    if len(rows) == 0:
        return {}
    prompts, references = list(rows[args.prompt_column]), list(rows[args.response_column])
    answers = generate_answers(model, tokenizer, prompts, args.max_new_tokens, desc=desc)
    score = evaluate.load(EXACT_MATCH_PATH).compute(predictions=answers, references=references)["exact_match"]
    shown = [
        {"prompt": p, "expected": r, "generated": a} for p, r, a in list(zip(prompts, references, answers, strict=True))
    ]
    return {"exact_match": score, "examples": shown[: args.show_generations]}


@torch.no_grad()
def generate_answers(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 32,
    desc: str = "Generating",
) -> list[str]:
    """Greedy answers to `prompts`. A sharded model splits them across ranks (all ranks must call);
    a plain model on one rank answers them all."""
    sharded = dist.is_initialized() and dist.get_world_size() > 1 and getattr(model, "_is_fsdp_managed_module", False)
    world, rank = (dist.get_world_size(), dist.get_rank()) if sharded else (1, 0)
    mine = prompts[rank::world]
    per_rank = -(-len(prompts) // world)
    mine += [prompts[0]] * (per_rank - len(mine))  # equal batch counts on every rank
    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    model.eval()
    answers: list[str] = []
    try:
        for start in tqdm(range(0, len(mine), batch_size), desc=desc, disable=not is_rank0()):
            batch = tokenizer(mine[start : start + batch_size], return_tensors="pt", padding=True).to(device)
            # synced_gpus: a sharded forward is collective, so ranks that finish early keep stepping.
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=sharded,
            )
            answers += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train()
    if not sharded:
        return answers
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, answers[: len(prompts[rank::world])])
    ordered = [""] * len(prompts)
    for r, theirs in enumerate(gathered):
        ordered[r::world] = theirs
    return ordered


def load_export(output_dir: str, base: str, is_adapter: bool) -> nn.Module:
    """Load what the job exported the way a user would: from_pretrained (an adapter: onto its base)."""
    if os.path.isfile(os.path.join(output_dir, "adapter_config.json")) and is_adapter:
        from peft import PeftModel

        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), output_dir)
    return AutoModelForCausalLM.from_pretrained(output_dir)


def finish(summary: dict[str, Any], trainer: FSDP2Trainer, output_dir: str) -> None:
    """Rank 0: write the curves PNG and the summary JSON, and print the summary."""
    curves = write_outputs(
        summary, trainer.state.log_history, output_dir, {"train loss": "loss", "eval loss": "eval_loss"}
    )
    print(render_summary(summary, output_dir, curves, "job", ("eval_loss", "exact_match")))
