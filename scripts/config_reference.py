"""Print the FSDP2Config reference table (markdown) from the dataclass's own help text.

python scripts/config_reference.py            # print the table
python scripts/config_reference.py --check README.md   # exit 1 if README's table is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hf_fsdp2 import FSDP2Config

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"


def reference_table() -> str:
    """One row per FSDP2Config field: name, default, help."""
    rows = ["| field | default | what it does |", "|---|---|---|"]
    for field in dataclasses.fields(FSDP2Config):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        rows.append(f"| `{field.name}` | `{default!r}` | {field.metadata['help']} |")
    return "\n".join(rows)


def readme_table(path: str) -> str:
    """The table currently between the markers in the README."""
    text = open(path).read()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="README", help="compare with the table in this file")
    args = parser.parse_args()
    table = reference_table()
    if args.check:
        if readme_table(args.check) != table:
            print(f"{args.check}: the FSDP2Config table is stale; regenerate it with scripts/config_reference.py")
            return 1
        return 0
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
