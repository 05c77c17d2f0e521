"""The README's Quickstart commands are the ones CI runs, so following the README is what CI proves."""

from __future__ import annotations

import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def section_block(title: str) -> str:
    """The first ```bash block under a README heading."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index(f"## {title}") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip()


def quickstart() -> list[str]:
    """The Quickstart commands, one per line."""
    return [line for line in section_block("Quickstart").splitlines() if line.strip()]


def quickstart_main_job() -> tuple[str, list[str]]:
    """The main job's torchrun process count and arguments (script, config), as the README gives them."""
    _, run = quickstart()[0].split(" && ")
    tokens = shlex.split(run)
    assert tokens[:2] == ["torchrun", "--nproc_per_node"], run
    return tokens[2], tokens[3:]


def ci_lines() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_quickstart_is_two_commands_and_the_second_is_what_ci_runs():
    lines = quickstart()
    assert len(lines) == 2
    install, test = lines[1].split(" && ")
    assert f"python -m {install}" in ci_lines()
    assert test == ci_lines()[-1]


def test_quickstart_main_job_names_files_that_exist():
    install, _ = quickstart()[0].split(" && ")
    assert install.startswith("pip install torch==2.13.0 -e ")
    nproc, arguments = quickstart_main_job()
    assert nproc == "2"
    for path in arguments:
        assert os.path.isfile(os.path.join(ROOT, path)), path
