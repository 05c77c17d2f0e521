"""`hf-fsdp2 env`: every field a bug report needs, the in-range marks right, and fast (no training stack imported)."""

from __future__ import annotations

import platform
from importlib import metadata

import torch

from hf_fsdp2 import __version__
from hf_fsdp2.environment import report
from tests.launch import run_cli


def rows_of(text: str) -> dict[str, list[str]]:
    """The package table's rows by package name."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_the_report_names_every_field_and_marks_the_range():
    versions = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "accelerate": "1.15.0", "peft": "0.21.2"}
    text = report(versions.get)
    for field in (f"- hf_fsdp2: {__version__}", f"- Python: {platform.python_version()}", "- Platform: "):
        assert field in text
    assert "- torch build: " in text and "- Accelerator: " in text
    rows = rows_of(text)
    assert list(rows) == ["torch", "transformers", "accelerate", "peft", "trl", "torchao"]
    assert rows["torch"] == ["2.11.0+cu130", ">=2.11,<2.16", "yes"]
    assert rows["transformers"] == ["5.17.0", ">=5.23,<5.25", "**no**"]
    assert rows["trl"] == ["not installed", ">=1.16,<1.17 (`trl` extra)", "-"]
    assert rows["torchao"][2] == "-"


def test_the_command_reports_this_environment_without_the_training_stack():
    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "IMPORTED"
    rows = rows_of(proc.stdout)
    assert rows["torch"] == [metadata.version("torch"), ">=2.11,<2.16", "yes"]
    assert ("- Accelerator: none (CPU only)" in proc.stdout) == (not torch.accelerator.is_available())
