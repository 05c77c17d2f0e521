"""The `hf-fsdp2` command line: offline jobs on checkpoints, no process group needed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .consolidate import consolidate

    try:
        path = consolidate(args.checkpoint_dir, args.output_dir, args.max_shard_size, args.dtype, args.overwrite)
    except ValueError as error:
        print(f"hf-fsdp2 consolidate: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
