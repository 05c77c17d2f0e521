"""Packed causal-LM training with and without FSDP2Config(sequence_parallel_size=N), against plain Trainer.

Usage: sequence_parallel_worker.py --mode M --model PATH --out OUT [--sp N] [--rows-per-rank B] ... (or --batch FILE)
M: plain (transformers.Trainer, one process) | ours (FSDP2Trainer, any world size) | sft (TRL SFTTrainer through
FSDP2SFTTrainer, padding_free) | probe (no training: a packed row's logits through the split forward against the
unsplit model, and which positions move when every token of one document changes).
Writes OUT/result.json: per-step losses, eval loss, a digest of the final weights (probe: its counts).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from datasets import Dataset
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    Trainer,
    TrainingArguments,
)

from hf_fsdp2 import FSDP2Config, FSDP2Trainer
from tests.tiny_models import VOCAB, tiny_tokenizer
from tests.workers.scenarios import PARITY_ADAM_EPSILON, main_with_batches


def documents(n: int, seed: int = 0, shortest: int = 5, longest: int = 40) -> Dataset:
    """Documents of varying length; a prompt of a few tokens is masked (-100) in some of them."""
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {"input_ids": [], "labels": []}
    for index in range(n):
        length = int(torch.randint(shortest, longest + 1, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        prompt = min(length - 1, 4) if index % 3 == 0 else 0
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return Dataset.from_dict(rows)


def collator(name: str):
    """How rows are batched: packed (flattening, with or without flash kwargs) or right-padded."""
    if name == "flatten":
        return DataCollatorWithFlattening()
    if name == "flatten_flash_kwargs":
        return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    if name == "left_padded":
        tokenizer = tiny_tokenizer()
        tokenizer.padding_side = "left"
        return DataCollatorForLanguageModeling(tokenizer, mlm=False)
    tokenizer = tiny_tokenizer()
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


def arguments(out: str, opts: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=opts.rows_per_rank,
        per_device_eval_batch_size=opts.rows_per_rank,
        gradient_accumulation_steps=opts.accumulation,
        max_steps=opts.steps,
        learning_rate=1e-3,
        adam_epsilon=PARITY_ADAM_EPSILON,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if opts.save_steps else "no",
        save_steps=opts.save_steps or 500,
        report_to=[],
        seed=42,
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )


def fsdp2_config(opts: argparse.Namespace) -> FSDP2Config:
    return FSDP2Config(
        sequence_parallel_size=opts.sp,
        loss_chunk_size=opts.loss_chunk,
        fsdp_activation_checkpointing=opts.checkpointing,
        consolidate_on_train_end=opts.export,
        checkpoint_on_signals=[],
        hsdp_replicate_size=opts.hsdp,
    )


def build(opts: argparse.Namespace) -> Trainer:
    data, evaluation = documents(opts.rows), documents(8, seed=1)
    if "padded" in opts.collator:  # the padding collator makes the labels (-100 on padding) itself
        data, evaluation = data.remove_columns("labels"), evaluation.remove_columns("labels")
    common = dict(train_dataset=data, eval_dataset=evaluation, data_collator=collator(opts.collator))
    args = arguments(opts.out, opts)
    if opts.mode == "plain":
        model = AutoModelForCausalLM.from_pretrained(opts.model, attn_implementation=opts.attn)
        return Trainer(model, args, **common)
    if opts.mode == "dpo":  # refused: DPO scores whole rows' log-probs
        from trl import DPOConfig

        from hf_fsdp2.trl import FSDP2DPOTrainer

        dpo = DPOConfig(**{**args.to_dict(), "output_dir": opts.out}, max_length=32)
        pairs = Dataset.from_dict({"prompt": ["t5 t6"] * 8, "chosen": [" t7 t8"] * 8, "rejected": [" t9 t3"] * 8})
        return FSDP2DPOTrainer(
            opts.model, args=dpo, train_dataset=pairs, processing_class=tiny_tokenizer(),
            fsdp2_config=fsdp2_config(opts),
        )  # fmt: skip
    if opts.mode == "sft":
        from trl import SFTConfig

        from hf_fsdp2.trl import FSDP2SFTTrainer

        # padding_free: each batch's examples in one row; packing: TRL's best-fit packing into rows of 64 tokens.
        packing = dict(packing=True, max_length=64) if opts.sft_packing else dict(padding_free=True, max_length=None)
        sft = SFTConfig(**{**args.to_dict(), "output_dir": opts.out}, **packing)
        sft.model_init_kwargs = {"attn_implementation": opts.attn}
        text = Dataset.from_dict({"input_ids": data["input_ids"]})
        return FSDP2SFTTrainer(
            model=opts.model,
            args=sft,
            train_dataset=text,
            processing_class=tiny_tokenizer(),
            fsdp2_config=fsdp2_config(opts),
        )
    model = AutoModelForCausalLM.from_pretrained(opts.model, attn_implementation=opts.attn)
    if opts.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the adapters' initial weights, whatever ran before in this process
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return FSDP2Trainer(model, args, fsdp2_config=fsdp2_config(opts), **common)


def digest(trainer: Trainer) -> float:
    """Sum of |weights| over the full model: equal runs give equal sums (to rounding)."""
    model = trainer.model
    if isinstance(model, torch.distributed.fsdp.FSDPModule):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    return float(sum(v.double().abs().sum() for k, v in state.items() if v.is_floating_point()))


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["plain", "ours", "sft", "dpo", "probe"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--rows-per-rank", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--collator", default="flatten")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--loss-chunk", type=int, default=None)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--hsdp", type=int, default=1)
    parser.add_argument("--sft-packing", action="store_true")
    parser.add_argument("--export", action="store_true")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    opts = parser.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    if opts.mode == "probe":
        write(opts.out, probe(opts))
        return
    trainer = build(opts)
    trainer.train(resume_from_checkpoint=opts.resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss = trainer.evaluate()["eval_loss"] if opts.mode != "sft" else None
    result = {"losses": losses, "eval_loss": eval_loss, "digest": digest(trainer)}
    config = (trainer.model.get_base_model() if opts.lora else trainer.model).config
    result["attn_implementation"] = config._attn_implementation
    if opts.export:  # generate on the trained (sharded) model = generate on its exported folder, unsharded
        prompt = torch.tensor([[5, 9, 14, 3, 22]])
        sharded = trainer.model.generate(prompt, max_new_tokens=8, do_sample=False)
        exported = AutoModelForCausalLM.from_pretrained(opts.out).generate(prompt, max_new_tokens=8, do_sample=False)
        result["generate_same"] = sharded.tolist() == exported.tolist()
    write(opts.out, result)


def write(out: str, result: dict) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


def probe(opts: argparse.Namespace) -> dict:
    """Split forward of a packed row of three documents vs the unsplit model, and the perturbation counts."""
    from hf_fsdp2.distributed import get_device, init_distributed
    from hf_fsdp2.long_rows.sequence_parallel import SequenceParallel, check_model, split_row
    from hf_fsdp2.long_rows.ulysses_attention import RowLayout, documents_of, ulysses

    init_distributed()
    torch.manual_seed(0)
    device = get_device()  # NOTE: the sequence group's collectives take the accelerator's tensors on GPUs
    model = AutoModelForCausalLM.from_pretrained(opts.model, attn_implementation=opts.attn).eval().to(device)
    lengths = [17, 23, 11]
    ids = torch.randint(3, VOCAB, (1, sum(lengths))).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    changed = ids.clone()
    changed[:, : lengths[0]] = torch.randint(3, VOCAB, (1, lengths[0]))
    group = SequenceParallel(opts.sp, check_model(model, opts.sp, dist.get_world_size()))

    def split_logits(tokens: torch.Tensor, whole_row: bool = False) -> torch.Tensor:
        part = split_row({"input_ids": tokens, "position_ids": positions}, group.size, group.rank)
        documents = documents_of(part.pop("whole_positions"))
        if whole_row:  # what is_causal-only context parallelism does: one causal attention over the row
            documents = [[(0, documents[0][-1][1])]]
        layout = RowLayout(group.group, group.size, group.implementation, documents)
        with torch.no_grad(), ulysses(model.config, layout):
            local = model(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
        pieces = [torch.empty_like(local) for _ in range(group.size)]
        dist.all_gather(pieces, local.contiguous(), group=group.group)
        return torch.cat(pieces, dim=1)[:, : tokens.shape[1]]

    with torch.no_grad():
        # NOTE: use_cache=False: with a cache, transformers does not read packed documents from position ids.
        reference = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    split, split_changed = split_logits(ids), split_logits(changed)
    whole, whole_changed = split_logits(ids, True), split_logits(changed, True)
    first = lengths[0]

    def moved(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
        per_position = (a - b).abs().amax(-1)[0] > 1e-6
        return int(per_position[:first].sum()), int(per_position[first:].sum())

    return {
        "max_diff_vs_unsplit": (split - reference).abs().max().item(),
        "moved": moved(split, split_changed),
        "moved_whole_row_causal": moved(whole, whole_changed),
        "others": sum(lengths[1:]),
        "attn_implementation": model.config._attn_implementation,
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    main_with_batches(run)
