"""Run README Python snippets as written, in one process group, with the README's placeholders bound.

Usage: readme_snippets.py SNIPPETS_JSON WORKSPACE RUNS NAME [NAME ...]. Each snippet runs in
WORKSPACE/RUNS/NAME (where `path/to/hf-model` resolves to WORKSPACE's, as beside a user's script) in a
fresh namespace holding the placeholders (`train_ds`, `eval_ds`, `labeled_ds`, `sft_ds`, `tokenizer`), at
transformers' default verbosity, as a fresh script would. Rank 0 prints `=== README snippet NAME ===` to
stderr before each one, so the caller can split the log, and writes WORKSPACE/RUNS/NAME/outcome.json:
"ok" or the traceback.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import transformers
from datasets import Dataset

from tests.tiny_models import VOCAB, tiny_tokenizer
from tests.workers.train_worker import make_classification_dataset, make_dataset

RANK = int(os.environ.get("RANK", "0"))


def sft_rows(n: int = 16) -> Dataset:
    """Prompt/completion text in the tiny tokenizer's words."""
    g = torch.Generator().manual_seed(0)

    def words(k: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (k,), generator=g))

    return Dataset.from_dict({"prompt": [words(4) for _ in range(n)], "completion": [words(6) for _ in range(n)]})


def placeholders() -> dict[str, Any]:
    """What the README's snippets leave to the reader, filled with tiny data."""
    return {
        "train_ds": make_dataset(16, VOCAB),
        "eval_ds": make_dataset(8, VOCAB, seed=1),
        "labeled_ds": make_classification_dataset(16, VOCAB),
        "sft_ds": sft_rows(),
        "tokenizer": tiny_tokenizer(),
    }


def run_snippet(name: str, code: str, workspace: str, runs: str) -> None:
    """Execute one snippet in WORKSPACE/RUNS/NAME as a fresh `python snippet.py` would, recording its outcome."""
    folder = os.path.join(workspace, runs, name)
    os.makedirs(folder, exist_ok=True)
    try:  # `path/to/hf-model` as the reader has it, beside their script
        os.symlink(os.path.join(workspace, "path"), os.path.join(folder, "path"))
    except FileExistsError:
        pass
    os.chdir(folder)
    transformers.logging.set_verbosity_warning()  # a fresh script starts at transformers' default
    if RANK == 0:
        print(f"=== README snippet {name} ===", file=sys.stderr, flush=True)
    try:
        exec(compile(code, f"README.md:{name}", "exec"), {"__name__": "__main__", **placeholders()})
        outcome = "ok"
    except Exception:
        outcome = traceback.format_exc()
        print(outcome, file=sys.stderr, flush=True)
    if RANK == 0:
        with open(os.path.join(folder, "outcome.json"), "w") as f:
            json.dump(outcome, f)


def main() -> None:
    snippets_file, workspace, runs, *names = sys.argv[1:]
    with open(snippets_file) as f:
        snippets = json.load(f)
    for name in names:
        run_snippet(name, snippets[name], workspace, runs)


if __name__ == "__main__":
    main()
