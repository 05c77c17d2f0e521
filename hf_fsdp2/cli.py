"""The `hf-fsdp2` command line: one subcommand per offline job (none yet need a process group)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser; subcommands register themselves here."""
    parser = argparse.ArgumentParser(
        prog="hf-fsdp2",
        description="Tools for hf_fsdp2 checkpoints. Training itself runs through your script and FSDP2Trainer.",
    )
    parser.add_argument("--version", action="version", version=f"hf-fsdp2 {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
