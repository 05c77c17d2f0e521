"""The tested version ranges: one source (hf_fsdp2/requirements/*.txt) for pip and for the check that refuses an
untested torch/transformers/accelerate/peft in one line before any Trainer code runs.

The check itself is tested here with a version lookup that answers chosen versions (a pure function: no install is
needed to know it refuses 2.10). Whether the code runs on a real install of another version is what
scripts/test_other_versions.sh measures, one whole suite per install (too slow for the suite): its records are the
Tested versions table, rendered from them (the test below)."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from hf_fsdp2 import versions
from hf_fsdp2.versions import ALLOW_UNTESTED, UntestedVersionError, check_versions, in_range, tested_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTED = {"torch": "2.13.0+cpu", "transformers": "5.23.0", "accelerate": "1.15.0", "peft": "0.21.2"}


def installed(**versions: str):
    """A version lookup that answers the tested versions, with `versions` instead where given."""
    return lambda name: {**TESTED, **versions}.get(name)


@pytest.mark.parametrize(
    "name, version",
    [
        ("transformers", "5.23.0"),
        ("transformers", "5.24.0"),
        ("torch", "2.11.0+cu130"),  # the GPU images' own build
        ("torch", "2.15.0"),
        ("torch", "2.15.0rc1"),
        ("torch", "2.11.0rc1"),  # sorts below '>=2.11' itself: only counting it as 2.11.0 admits it
    ],
)
def test_tested_versions_are_accepted(name, version):
    check_versions(installed(**{name: version}))


@pytest.mark.parametrize(
    "name, version, needed",
    [
        ("transformers", "5.17.0", "transformers>=5.23,<5.25"),
        ("transformers", "5.25.0", "transformers>=5.23,<5.25"),
        ("torch", "2.10.0", "torch>=2.11,<2.16"),
        ("torch", "2.16.0.dev20260101+cpu", "torch>=2.11,<2.16"),
        ("accelerate", "1.14.0", "accelerate>=1.15,<1.16"),
    ],
)
def test_untested_versions_are_refused_in_one_line_naming_both(monkeypatch, name, version, needed):
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(UntestedVersionError) as caught:
        check_versions(installed(**{name: version}))
    message = str(caught.value)
    assert "\n" not in message
    assert f"{name} {version} is installed, hf_fsdp2 needs {needed}" in message
    assert f"pip install '{needed}'" in message


def test_every_untested_package_is_named_and_a_missing_one_is_not(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(UntestedVersionError, match="torch 2.9.0 .*; transformers 5.17.0 ") as caught:
        check_versions(installed(torch="2.9.0", transformers="5.17.0", peft=None))
    assert "peft" not in str(caught.value).split(". Install")[0]


def test_allow_untested_warns_instead(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match=r"transformers 5.25.0 is installed.*running anyway"):
        check_versions(installed(transformers="5.25.0"))


def test_the_ranges_are_what_setup_cfg_installs():
    """setup.cfg installs from the files the check reads; the dev extra repeats the trl and qlora ranges."""
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    assert config["options"]["install_requires"].strip() == "file: hf_fsdp2/requirements/core.txt"
    extras = config["options.extras_require"]
    assert extras["trl"].strip() == "file: hf_fsdp2/requirements/trl.txt"
    assert extras["qlora"].strip() == "file: hf_fsdp2/requirements/qlora.txt"
    dev = [line.strip() for line in extras["dev"].splitlines()]
    for name in ("trl", "torchao"):
        line = next(r for r in dev if r.startswith(name + ">"))
        assert set(line[len(name) :].split(",")) == {str(s) for s in versions.tested_ranges()[name]}, line
    assert in_range("torch", "2.11.0") and not in_range("torch", "2.10.1")


def test_an_old_transformers_is_refused_at_first_use_and_at_trainer_construction():
    """In a fresh process that sees transformers 5.17.0: building a trainer, and `from hf_fsdp2 import ...`, each
    fail with the one line (and `import hf_fsdp2` itself does not, so `hf-fsdp2 env` can still report)."""
    code = (
        "import importlib.metadata as metadata\n"
        "real = metadata.version\n"
        "metadata.version = lambda name: '5.17.0' if name == 'transformers' else real(name)\n"
        "import hf_fsdp2.trainer\n"
        "for attempt in (lambda: hf_fsdp2.trainer.FSDP2Trainer(model=None), lambda: hf_fsdp2.FSDP2Config):\n"
        "    try:\n"
        "        attempt()\n"
        "    except ImportError as error:\n"
        "        print(type(error).__name__, error)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith("UntestedVersionError transformers 5.17.0 is installed, hf_fsdp2 needs transformers>=")


def test_the_versions_tables_are_the_render_of_the_recorded_runs():
    """A formatting check: README.md's and docs/development.md's tables are rendered from scripts/results/versions/
    (re-render: python scripts/docs/versions_table.py)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "docs"))
    import versions_table

    table = versions_table.render_table(versions_table.load_records())
    for page in versions_table.PAGES:
        with open(page) as f:
            assert versions_table.rewrite(page, table) == f.read(), f"{page}: python scripts/docs/versions_table.py"


def admitted_minors(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The lowest and highest minor version `name`'s tested range admits (">=2.11,<2.16": 2.11 and 2.15)."""
    bounds = {spec.operator: Version(spec.version).release for spec in tested_ranges()[name]}
    low, high = bounds[">="], bounds["<"]
    return (low[0], low[1]), (high[0], high[1] - 1)


def test_the_ranges_claim_only_what_whole_runs_passed():
    """Every corner of the torch x transformers ranges has a whole-suite run that passed, and no recorded run inside
    the ranges failed: widen or keep a range only with the rows to show for it (docs/development.md)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "docs"))
    import versions_table

    runs = {}
    for entry in versions_table.load_records():
        key = tuple(Version(entry["versions"][name]).release[:2] for name in ("torch", "transformers"))
        runs[key] = versions_table.passed(entry)
    corners = {(t, tf) for t in admitted_minors("torch") for tf in admitted_minors("transformers")}
    assert {corner: runs.get(corner) for corner in corners} == dict.fromkeys(corners, True)
    inside = [
        key
        for key in runs
        if all(in_range(n, ".".join(map(str, v))) for n, v in zip(("torch", "transformers"), key, strict=True))
    ]
    assert [key for key in inside if not runs[key]] == []
