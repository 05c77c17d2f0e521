"""Regenerate the docs' `hf-fsdp2 plan` example (docs/plan.md) from the planner itself, or check that it is current.

    python scripts/docs/readme_plan_example.py            # rewrite the block in docs/plan.md
    python scripts/docs/readme_plan_example.py --check    # exit 1 when the page's block is not what the planner prints

The block's first line is the command (`$ hf-fsdp2 plan llama-medium ...`); `llama-medium` is the ~100M Llama
that scripts/measure/validate_plan.py measures as "medium" (12 layers of 768, vocabulary 16000). Only its config.json
is written, in a temporary folder: the planner reads nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "measure"))
from validate_plan import SIZES  # noqa: E402

ROOT = os.path.dirname(SCRIPTS)
BLOCK = re.compile(r"```\n(\$ hf-fsdp2 plan (llama-medium [^\n]*))\n(.*?)```", re.S)


def planner_output(arguments: list[str]) -> str:
    """What `hf-fsdp2 plan llama-medium ARGS` prints, run in a folder holding llama-medium/config.json."""
    from transformers import LlamaConfig

    from hf_fsdp2.cli import main

    layers, hidden = SIZES["medium"]
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
    )
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(os.path.join(folder, "llama-medium"))
        os.chdir(folder)
        try:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                main(["plan", *arguments])
        finally:
            os.chdir(here)
    return printed.getvalue()


def current_block(readme: str) -> tuple[re.Match, str]:
    """The page's example block and what the planner prints for its command today."""
    text = open(readme).read()
    match = BLOCK.search(text)
    if match is None:
        raise SystemExit(f"{readme}: no ``` block starting with '$ hf-fsdp2 plan llama-medium ...'")
    return match, planner_output(shlex.split(match[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("readme", nargs="?", default=os.path.join(ROOT, "docs", "plan.md"))
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting")
    args = parser.parse_args()
    match, printed = current_block(args.readme)
    if args.check:
        if match[3] != printed:
            print(
                f"{args.readme}: the plan example is stale; run scripts/docs/readme_plan_example.py. "
                f"It prints:\n{printed}"
            )
            return 1
        return 0
    text = open(args.readme).read()
    with open(args.readme, "w") as f:
        f.write(text[: match.start(3)] + printed + text[match.end(3) :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
