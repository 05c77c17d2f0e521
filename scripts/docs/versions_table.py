"""The Tested versions table of README.md and docs/development.md: one row per torch x transformers pair, each the
latest whole-suite run recorded by scripts/test_other_versions.sh on this code base.

python scripts/docs/versions_table.py                      # rewrite both tables from scripts/results/versions/
python scripts/docs/versions_table.py --check              # exit 1 when a table is not the render of the records
python scripts/docs/versions_table.py --record run.xml ... # what test_other_versions.sh calls after a run

A record (scripts/results/versions/torch-X_transformers-Y.json) holds the installed versions, pytest's counts read
from its JUnit XML, the wall time, the date and the commit. A run of part of the suite (a path or `-k` given to the
script) is not recorded: a row says what the whole suite did. The table is written between the markers
`<!-- versions table -->` and `<!-- /versions table -->`; tests/test_versions.py checks that it is the render of
the records.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = os.path.join(ROOT, "scripts", "results", "versions")
PAGES = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "development.md")]
BEGIN, END = "<!-- versions table -->", "<!-- /versions table -->"
PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl")


def counts(junit_xml: str) -> dict[str, int]:
    """pytest's passed/failed/errors/skipped from its JUnit XML (one testsuite per run)."""
    suites = ET.parse(junit_xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    assert suite is not None, f"{junit_xml} holds no testsuite"
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors, "skipped": skipped}


def installed_versions() -> dict[str, str]:
    """The versions of PACKAGES in this interpreter's environment, as pip sees them."""
    from importlib.metadata import version

    return {name: version(name) for name in PACKAGES}


def torch_build() -> str:
    """How the installed torch was built, as the table says it: the CPU build, or a CUDA build run on the CPU."""
    import torch

    if "+cpu" in torch.__version__:
        return "CPU build"
    if torch.version.cuda and not torch.cuda.is_available():
        return "PyPI's CUDA build, run on the CPU"
    return "CUDA build" if torch.version.cuda else ""


def record(junit_xml: str, seconds: float) -> str:
    """Write this environment's record of a whole-suite run; returns its path."""
    versions = installed_versions()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    entry: dict[str, Any] = {
        "versions": versions,
        "build": torch_build(),
        "counts": counts(junit_xml),
        "seconds": round(seconds),
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
    }
    os.makedirs(RECORDS, exist_ok=True)
    torch_minor = ".".join(map(str, Version(versions["torch"]).release[:2]))  # "2.15.0+cpu" -> "2.15"
    path = os.path.join(RECORDS, f"torch-{torch_minor}_transformers-{versions['transformers']}.json")
    with open(path, "w") as f:
        json.dump(entry, f, indent=1)
        f.write("\n")
    return path


def load_records(folder: str = RECORDS) -> list[dict[str, Any]]:
    """Every record, ordered by torch then transformers version."""
    records = []
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            records.append(json.load(f))

    def key(entry: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        return tuple(Version(entry["versions"][name]).release for name in ("torch", "transformers"))

    return sorted(records, key=key)


def passed(entry: dict[str, Any]) -> bool:
    """A whole suite with nothing failed and no error."""
    c = entry["counts"]
    return c["passed"] > 0 and c["failed"] == 0 and c["errors"] == 0


def _duration(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60} s"


def render_table(records: list[dict[str, Any]]) -> str:
    """The markdown table, one row per record."""
    lines = [
        "| torch | transformers | accelerate | peft | trl | whole suite | time | on | commit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in records:
        v, c = entry["versions"], entry["counts"]
        result = f"{c['passed']} passed"
        result += "".join(f", {c[k]} {k}" for k in ("failed", "errors") if c[k])
        result += f", {c['skipped']} skipped" if c["skipped"] else ""
        torch_cell = f"{v['torch']} ({entry['build']})" if entry.get("build") else v["torch"]
        cells = [torch_cell, *(v[name] for name in PACKAGES[1:]), result, _duration(entry["seconds"])]
        cells += [entry["date"], entry["commit"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rewrite(page: str, table: str) -> str:
    """The page's text with the table between the markers replaced."""
    with open(page) as f:
        text = f.read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page's table is not the records' render")
    parser.add_argument("--record", metavar="JUNIT_XML", help="record this environment's whole-suite run")
    parser.add_argument("--seconds", type=float, default=0.0, help="the run's wall time (with --record)")
    args = parser.parse_args(argv)
    if args.record:
        print("recorded", record(args.record, args.seconds))
        return 0
    table = render_table(load_records())
    stale = []
    for page in PAGES:
        text = rewrite(page, table)
        with open(page) as f:
            if f.read() == text:
                continue
        if args.check:
            stale.append(os.path.relpath(page, ROOT))
        else:
            with open(page, "w") as f:
                f.write(text)
    if stale:
        print(f"stale versions table in {', '.join(stale)}: run python scripts/docs/versions_table.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
