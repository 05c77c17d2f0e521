"""The `hf-fsdp2` command line: offline jobs on checkpoints and run planning, no process group needed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__
from .config import DTYPES


def build_parser() -> argparse.ArgumentParser:
    """Return the parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="hf-fsdp2",
        description="Tools for hf_fsdp2 checkpoints. Training itself runs through your script and FSDP2Trainer.",
    )
    parser.add_argument("--version", action="version", version=f"hf-fsdp2 {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    consolidate = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into a from_pretrained-ready Hugging Face folder",
        description="Stream a sharded checkpoint (FSDP2Trainer's, or Trainer + Accelerate's SHARDED_STATE_DICT) "
        "into model.safetensors (or shards + index), config and tokenizer files. "
        "Memory: about twice the largest tensor, never the model.",
    )
    consolidate.add_argument("checkpoint_dir", help="a checkpoint-N folder or its pytorch_model_fsdp_0 folder")
    consolidate.add_argument("output_dir", help="where to write the Hugging Face folder")
    consolidate.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    consolidate.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast floating tensors")
    consolidate.add_argument("--overwrite", action="store_true", help="write into a non-empty output_dir")
    _add_plan_parser(commands)
    commands.add_parser(
        "env",
        help="print the versions and hardware a bug report needs (markdown)",
        description="Print hf_fsdp2's version, Python, the platform, torch's CUDA build, the accelerator and its "
        "count, and the versions of torch, transformers, accelerate, peft, trl and torchao with whether each is "
        "inside the range hf_fsdp2 is tested with: paste it into a GitHub issue.",
    )
    return parser


def _add_plan_parser(commands: Any) -> None:
    """`hf-fsdp2 plan`: per-rank memory of every phase of a run, before launching it."""
    plan = commands.add_parser(
        "plan",
        help="predict each rank's memory in every phase of a run, and whether it fits",
        description="Reads only the model's config (a folder or config.json), builds it on the meta device and "
        "traces one forward/backward on fake tensors for the activations.",
    )
    plan.add_argument("model", help="a Hugging Face model folder or its config.json")
    plan.add_argument("--nproc", type=int, default=1, help="ranks in all (torchrun --nproc_per_node x nodes)")
    plan.add_argument("--hsdp", type=int, default=1, help="HSDP replicas (hsdp_replicate_size)")
    plan.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    plan.add_argument("--lora", default=None, metavar="r=16,targets=q_proj,v_proj", help="train a LoRA adapter")
    plan.add_argument("--qlora", action="store_true", help="with --lora: a 4-bit NF4 base (QLoRA)")
    plan.add_argument("--batch", type=int, default=1, help="per-device batch size")
    plan.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    plan.add_argument("--activation-checkpointing", action="store_true")
    plan.add_argument(
        "--loss-chunk-size", type=int, default=None, metavar="T", help="FSDP2Config(loss_chunk_size=T): chunked loss"
    )
    plan.add_argument(
        "--sequence-parallel",
        type=int,
        default=1,
        metavar="N",
        help="FSDP2Config(sequence_parallel_size=N): N ranks share each row (--loss-chunk-size 4096 unless given)",
    )
    plan.add_argument(
        "--generate", type=int, default=0, metavar="N", help="add generate() of N new tokens after --seq-token prompts"
    )
    plan.add_argument("--cpu-offload", action="store_true")
    plan.add_argument("--compile", action="store_true", help="FSDP2Config(compile=True): each block torch.compiled")
    plan.add_argument("--optim", default="adamw_torch_fused", help="TrainingArguments.optim (default: Trainer's)")
    plan.add_argument("--device-memory", default=None, help="memory per rank, e.g. 80GiB (default: detected)")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--cpu", action="store_true", default=None, help="a run without GPUs (default: this machine)")
    where.add_argument(
        "--gpu", dest="cpu", action="store_false", help="a run on GPUs, planned from a machine without one"
    )
    plan.add_argument("--json", action="store_true", help="print the figures as JSON")


def parse_lora(text: str) -> tuple[int, tuple[str, ...]]:
    """`r=16,targets=q_proj,v_proj` → (16, ("q_proj", "v_proj")).

    Raises:
        ValueError: when r is missing or not a positive integer.
    """
    r, targets, key = None, [], None
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if sep:
            key = name.strip()
            item = value
        if key == "r":
            r = item.strip()
        elif key == "targets":
            targets.append(item.strip())
        else:
            raise ValueError(f"--lora {text!r}: write r=16,targets=q_proj,v_proj")
    if r is None or not r.isdigit() or int(r) < 1:
        raise ValueError(f"--lora {text!r}: r must be a positive integer (r=16,targets=q_proj,v_proj)")
    return int(r), tuple(t for t in targets if t)


def _run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table or JSON); exit 0 when training fits, 1 when it does not, 3 when untraced activations
    leave it open."""
    import json

    from .config import FSDP2Config, parse_size
    from .planning.memory_plan import plan
    from .planning.plan_table import format_plan
    from .planning.plan_types import DEFAULT_LORA_TARGETS

    r, targets = parse_lora(args.lora) if args.lora else (None, DEFAULT_LORA_TARGETS)
    result = plan(
        args.model, nproc=args.nproc, hsdp=args.hsdp, bf16=args.bf16, lora_r=r,
        lora_targets=targets or DEFAULT_LORA_TARGETS, batch=args.batch, seq=args.seq, qlora=args.qlora,
        loss_chunk_size=FSDP2Config(
            loss_chunk_size=args.loss_chunk_size, sequence_parallel_size=args.sequence_parallel
        ).effective_loss_chunk_size,
        sequence_parallel=args.sequence_parallel, generate_tokens=args.generate,
        activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload, optim=args.optim,
        device_memory=parse_size(args.device_memory) if args.device_memory else None, cpu=args.cpu,
        compile=args.compile,
    )  # fmt: skip
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    if result.not_traced is not None and result.fits:
        return 3  # part of the peak is unknown: neither "fits" nor "does not fit" can be promised
    return 0 if result.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "env":
        from .environment import report

        print(report())
        return 0
    from .versions import UntestedVersionError, check_versions_once

    try:
        check_versions_once()
    except UntestedVersionError as error:
        print(f"hf-fsdp2 {args.command}: error: {error}", file=sys.stderr)
        return 2
    if args.command == "plan":
        try:
            return _run_plan(args)
        except ValueError as error:
            print(f"hf-fsdp2 plan: error: {error}", file=sys.stderr)
            return 2
    from .export.consolidation import consolidate

    try:
        path = consolidate(args.checkpoint_dir, args.output_dir, args.max_shard_size, args.dtype, args.overwrite)
    except ValueError as error:
        print(f"hf-fsdp2 consolidate: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
