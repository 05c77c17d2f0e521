"""Job data on disk: JSON-lines files, one example per line, read into an in-memory Dataset."""

from __future__ import annotations

import json

from datasets import Dataset


def read_jsonl(path: str) -> Dataset:
    """A JSON-lines file as an in-memory Dataset (no cache files, so ranks never race on a cache)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows; expected one JSON object per line.")
    return Dataset.from_list(rows)
