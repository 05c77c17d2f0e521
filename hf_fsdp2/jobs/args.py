"""Recipe command lines: a YAML config plus overrides, parsed into dataclasses by `HfArgumentParser`.

    python recipe.py recipes/configs/x.yaml learning_rate=1e-4 --max_steps 50 --bf16

Every field of every dataclass given (TrainingArguments, FSDP2Config, the recipe's own) can be set in
the YAML file or overridden on the command line; later values win. Values are read as YAML scalars
and rendered as command-line tokens, so a value means the same in the file and on the command line.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable
from typing import Any

import yaml
from transformers import HfArgumentParser

CONFIG_SUFFIXES = (".yaml", ".yml")


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Return the YAML config path (first `*.yaml` argument or `--config PATH`) and the other arguments."""
    rest: list[str] = []
    config: str | None = None
    tokens = iter(argv)
    for token in tokens:
        if token in ("--config", "-c"):
            config = next(tokens, None)
            if config is None:
                raise ValueError("--config needs a path to a YAML file.")
        elif token.startswith("--config="):
            config = token.split("=", 1)[1]
        elif config is None and token.endswith(CONFIG_SUFFIXES) and not token.startswith("-"):
            config = token
        else:
            rest.append(token)
    return config, rest


def override_tokens(tokens: list[str]) -> list[str]:
    """Rewrite `key=value` overrides as `--key value`; `--key value` and `--flag` pass through."""
    out: list[str] = []
    for token in tokens:
        if token.startswith("-"):
            out.append(token)
        elif "=" in token:
            key, _, value = token.partition("=")
            out += [f"--{key}", value]
        elif out and out[-1].startswith("--"):
            out.append(token)  # the value of a preceding --key
        else:
            raise ValueError(f"cannot read {token!r}: write overrides as key=value or --key value.")
    return out


def config_tokens(values: dict[str, Any], parser: HfArgumentParser) -> list[str]:
    """Render a YAML mapping as command-line tokens, so argparse converts types exactly as on a command line."""
    actions = {action.dest: action for action in parser._actions}
    out: list[str] = []
    for key, value in values.items():
        if value is None:
            continue  # the field's default
        if isinstance(value, bool):
            out += [f"--{key}", str(value).lower()]
        elif isinstance(value, list) and actions[key].nargs in ("+", "*"):
            out += [f"--{key}", *map(str, value)]
        elif isinstance(value, list):
            out += [f"--{key}", ",".join(map(str, value))]
        elif isinstance(value, dict):
            out += [f"--{key}", json.dumps(value)]
        else:
            out += [f"--{key}", str(value)]
    return out


def load_config(path: str) -> dict[str, Any]:
    """Read a YAML mapping; raise ValueError naming the file when it is missing or not a mapping."""
    if not os.path.isfile(path):
        raise ValueError(f"config file {path} does not exist.")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping of field: value, not {type(data).__name__}.")
    return data


def parse_recipe_args(dataclass_types: Iterable[type], argv: list[str]) -> tuple[Any, ...]:
    """Build the dataclasses from a YAML config and command-line overrides (overrides win)."""
    parser = HfArgumentParser(tuple(dataclass_types))
    config_path, rest = split_config(argv)
    values = load_config(config_path) if config_path else {}
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        hints = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
        described = ", ".join(f"{k} (did you mean {h[0]}?)" if h else k for k, h in hints.items())
        raise ValueError(
            f"{config_path}: unknown setting(s) {described}. Every TrainingArguments and FSDP2Config field is allowed."
        )
    # argparse keeps the last value given for a field, so command-line overrides win over the file.
    tokens = _cpu_default(known) + config_tokens(values, parser) + override_tokens(rest)
    return parser.parse_args_into_dataclasses(args=tokens)


def require_eval_file(eval_file: str | None, eval_strategy: Any) -> None:
    """Refuse periodic evaluation without an eval file before anything is built, naming both ways out.

    Raises:
        ValueError: when `eval_strategy` is not "no" and no `eval_file` was given.
    """
    strategy = str(getattr(eval_strategy, "value", eval_strategy))
    if eval_file is None and strategy != "no":
        raise ValueError(
            f"eval_strategy={strategy} evaluates during training, but no eval_file was given: add eval_file=eval.jsonl "
            "(same format as train_file), or eval_strategy=no."
        )


def _cpu_default(known: set[str]) -> list[str]:
    """Default `use_cpu` to true on a machine without an accelerator (the file or command line may override).

    FSDP2Trainer would find the CPU process group by itself, but TrainingArguments refuses `bf16=true` on a
    machine without GPUs unless `use_cpu` is set, and the configs' commands may ask for bf16."""
    import torch

    return ["--use_cpu", "true"] if "use_cpu" in known and not torch.accelerator.is_available() else []
