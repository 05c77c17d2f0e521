"""Print the FSDP2Config reference (markdown tables, one per group of fields) from the dataclass's own help text.

python scripts/docs/config_reference.py                                 # print the tables
python scripts/docs/config_reference.py --write docs/reference/config.md   # rewrite them between the page's markers
python scripts/docs/config_reference.py --check docs/reference/config.md   # exit 1 if the page's tables are stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hf_fsdp2 import FSDP2Config

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"
# The fields grouped by the job they configure, in the order a reader meets those jobs. A new field must be placed
# in a group here: reference_tables() fails naming it otherwise.
GROUPS = {
    "Sharding: which modules become units, and across which ranks": [
        "auto_wrap_policy",
        "transformer_layer_cls_to_wrap",
        "min_num_params",
        "branch_modules",
        "reshard_after_forward",
        "hsdp_replicate_size",
    ],
    "Precision and memory": [
        "param_dtype",
        "reduce_dtype",
        "base_quantization",
        "cpu_offload",
        "fsdp_activation_checkpointing",
        "compile",
        "float8",
    ],
    "The training step: long rows, gradients, generation": [
        "loss_chunk_size",
        "sequence_parallel_size",
        "defer_gradient_sync",
        "gather_for_generate",
    ],
    "Checkpoints and preemption": [
        "async_save",
        "checkpoint_writes",
        "checkpoint_on_signals",
        "signal_check_steps",
    ],
    "Export: the Hugging Face folder": [
        "consolidate_on_train_end",
        "merge_adapters_on_save",
        "export_dtype",
        "max_shard_size",
    ],
}


def reference_tables() -> str:
    """One table per group; one row per FSDP2Config field: name, default, help.

    Raises:
        ValueError: when a field is in no group, or a group names a field that does not exist.
    """
    fields = {field.name: field for field in dataclasses.fields(FSDP2Config)}
    grouped = [name for names in GROUPS.values() for name in names]
    if missing := [name for name in fields if name not in grouped]:
        raise ValueError(f"FSDP2Config fields in no group: {missing}; add each to GROUPS in {__file__}")
    if unknown := [name for name in grouped if name not in fields]:
        raise ValueError(f"GROUPS names fields FSDP2Config does not have: {unknown}")
    sections = []
    for title, names in GROUPS.items():
        rows = [f"### {title}", "", "| field | default | what it does |", "|---|---|---|"]
        for name in names:
            field = fields[name]
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            rows.append(f"| `{field.name}` | `{default!r}` | {field.metadata['help']} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


def page_tables(path: str) -> str:
    """The tables currently between the markers of a page."""
    text = open(path).read()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="PAGE", help="compare with the tables in this file")
    parser.add_argument("--write", metavar="PAGE", help="rewrite the tables in this file")
    args = parser.parse_args()
    tables = reference_tables()
    if args.check:
        if page_tables(args.check) != tables:
            print(f"{args.check}: the FSDP2Config tables are stale; regenerate them with {__file__} --write")
            return 1
        return 0
    if args.write:
        text = open(args.write).read()
        begin, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        with open(args.write, "w") as f:
            f.write(text[:begin] + "\n" + tables + "\n" + text[end:])
        return 0
    print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
