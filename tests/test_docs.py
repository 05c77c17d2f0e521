"""The docs' map of the code stays the code's: docs/how-it-works.md names every module of the package, and no other."""

from __future__ import annotations

import os
import re

from tests.launch import ROOT

PACKAGE = os.path.join(ROOT, "hf_fsdp2")


def package_modules() -> set[str]:
    """Every module of hf_fsdp2 outside the recipes' jobs, as a path under hf_fsdp2/ (rooms' __init__ files apart)."""
    found = set()
    for folder, _, files in os.walk(PACKAGE):
        room = os.path.relpath(folder, PACKAGE)
        if room.split(os.sep)[0] in ("jobs", "__pycache__"):
            continue
        for name in files:
            if name.endswith(".py") and not (name == "__init__.py" and room != "."):
                found.add(os.path.normpath(os.path.join(room, name)))
    return found


def test_how_it_works_module_table_names_every_module_once():
    with open(os.path.join(ROOT, "docs", "how-it-works.md")) as f:
        page = f.read()
    table = next(part for part in page[page.index("## Read the code") :].split("\n\n") if part.startswith("| room"))
    named = re.findall(r"`([\w/]+\.py)`", "\n".join(row.split("|")[2] for row in table.splitlines()[2:]))
    assert sorted(named) == sorted(set(named)), "a module is named twice"
    assert set(named) == package_modules()
