"""Build an FSDP2Trainer from one of the load routes and dump what every rank ended up with.

Rank 0 writes `state.pt` (full parameters and every buffer, gathered) and `info.json` into --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainingArguments, set_seed

from hf_fsdp2 import FSDP2Config, FSDP2Trainer, close_distributed, from_pretrained
from tests.workers.scenarios import main_with_batches

LORA_KWARGS = dict(r=4, target_modules=["q_proj", "v_proj"])
CLASSES = {"causal": AutoModelForCausalLM, "classify": AutoModelForSequenceClassification}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--route", default="path", choices=["path", "from_pretrained", "object", "object_rank0", "meta_object"]
    )
    p.add_argument("--task", default="causal", choices=list(CLASSES))
    p.add_argument("--hsdp", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--lora", action="store_true", help="wrap the model with peft LoRA (q_proj, v_proj)")
    p.add_argument("--adapter", default=None, help="wrap the model with this saved adapter (PeftModel.from_pretrained)")
    p.add_argument("--rank1-min-params", type=int, default=None, help="give rank 1 a different config")
    p.add_argument("--overwrite", action="store_true", help="zero the checkpoint's bytes in place once loaded")
    return p.parse_args(argv)


def build(args: argparse.Namespace, rank: int):
    set_seed(42)  # weights the checkpoint lacks draw from the RNG as of the skeleton, as in from_pretrained
    kwargs = {"num_labels": 3} if args.task == "classify" else {}
    auto = CLASSES[args.task]
    if args.route == "path":
        return args.model
    if args.route == "meta_object":
        # A meta model that does not say where its weights are: nothing can fill it.
        skeleton = from_pretrained(args.model, auto, **kwargs)
        delattr(skeleton, "_hf_fsdp2_source")
        return skeleton
    if args.route == "from_pretrained" or (args.route == "object_rank0" and rank != 0):
        return from_pretrained(args.model, auto, **kwargs)
    return auto.from_pretrained(args.model, **kwargs)


def overwrite_in_place(path: str, rank: int) -> None:
    """Zero every tensor byte of the file in place (same inode, as `cp` or `rsync --inplace` onto it would)."""
    torch.distributed.barrier()
    if rank == 0:
        with open(path, "r+b") as f:
            header = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            f.seek(8 + header)
            f.write(bytes(size - 8 - header))
    torch.distributed.barrier()


def load(argv: list[str]) -> None:
    """Build, shard and load one model as the flags say; rank 0 writes OUT/state.pt and OUT/info.json."""
    args = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    min_params = args.rank1_min_params if (args.rank1_min_params and rank == 1) else 100_000_000
    config = FSDP2Config(hsdp_replicate_size=args.hsdp, min_num_params=min_params, cpu_offload=args.offload)
    training_args = TrainingArguments(
        output_dir=os.path.join(args.out, "run"), report_to=[], seed=42, bf16=args.bf16, use_cpu=True
    )
    model = build(args, rank)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(from_pretrained(model) if isinstance(model, str) else model, LoraConfig(**LORA_KWARGS))
    if args.adapter:
        from peft import PeftModel

        base = from_pretrained(model) if isinstance(model, str) else model
        model = PeftModel.from_pretrained(base, args.adapter, is_trainable=True)
    trainer = FSDP2Trainer(model, training_args, fsdp2_config=config)
    model = trainer.model
    if args.overwrite:
        overwrite_in_place(os.path.join(args.model, "model.safetensors"), rank)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {f"buffer:{name}": b.detach().cpu().clone() for name, b in model.named_buffers()}
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    info = {
        "tied": tied,
        "num_params": len(list(model.parameters())),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
    }
    if rank == 0:
        torch.save({**state, **buffers}, os.path.join(args.out, "state.pt"))
        with open(os.path.join(args.out, "info.json"), "w") as f:
            json.dump(info, f)


def main() -> None:
    main_with_batches(load)
    close_distributed()


if __name__ == "__main__":
    main()
