"""The README's commands are the ones CI runs, so following the README is what CI proves."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section_block(title: str) -> str:
    """The first ```bash block under a README heading."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index(f"## {title}") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip()


def ci_lines() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_ci_installs_with_the_readme_install_command():
    install = section_block("Install")
    assert f"python -m {install}" in ci_lines()


def test_ci_runs_the_readme_test_command():
    assert section_block("Run the tests") == ci_lines()[-1]
