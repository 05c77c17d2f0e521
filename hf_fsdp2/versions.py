"""The versions hf_fsdp2 is tested with, and the check that refuses others before they fail deep inside Trainer.

The ranges are read from hf_fsdp2/requirements/*.txt, the same files setup.cfg installs from, so what pip admits and
what the check admits cannot drift apart. Imports nothing heavy: `hf-fsdp2 env` reports the versions through it even
where they are out of range.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import cache
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements")
# What a wrong version breaks in ways that surface far from the cause: private Trainer and Accelerate hooks, FSDP2
# and DCP internals, peft's adapter state. The other requirements (datasets, safetensors, evaluate) fail plainly.
CHECKED = ("torch", "transformers", "accelerate", "peft")
# Set to 1 to run on versions outside the tested ranges (one warning instead of the error): how a new release is
# tried (scripts/test_other_versions.sh), never needed to use the tested ones.
ALLOW_UNTESTED = "HF_FSDP2_ALLOW_UNTESTED"


class UntestedVersionError(ImportError):
    """An installed torch/transformers/accelerate/peft outside the range hf_fsdp2 was tested with."""


@cache
def tested_ranges() -> dict[str, SpecifierSet]:
    """Each requirement's tested range by package name: the core ones and the trl and qlora extras."""
    ranges = {}
    for name in ("core.txt", "trl.txt", "qlora.txt"):
        with open(os.path.join(REQUIREMENTS, name)) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line:
                    requirement = Requirement(line)
                    ranges[requirement.name] = requirement.specifier
    return ranges


def range_text(name: str) -> str:
    """`name`'s tested range as a requirement reads: "transformers>=5.23,<5.25"."""
    bounds = sorted(map(str, tested_ranges()[name]), key=lambda bound: (not bound.startswith(">"), bound))
    return name + ",".join(bounds)


def installed_version(name: str) -> str | None:
    """The installed distribution's version (as pip sees it), or None when it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def in_range(name: str, installed: str) -> bool:
    """Whether `installed` lies in `name`'s tested range; local builds (2.11.0+cu130) and release candidates of a
    version in the range count as that version."""
    try:
        parsed = Version(installed)
    except InvalidVersion:
        return False
    return tested_ranges()[name].contains(Version(parsed.base_version))


def untested(get_version: Callable[[str], str | None] = installed_version) -> dict[str, str]:
    """The checked packages installed outside their tested range, with their installed versions."""
    found = {}
    for name in CHECKED:
        installed = get_version(name)
        if installed is not None and not in_range(name, installed):
            found[name] = installed
    return found


def check_versions(get_version: Callable[[str], str | None] = installed_version) -> None:
    """Refuse, in one line naming the installed and the needed versions, a torch/transformers/accelerate/peft the
    suite was not run on (an old transformers otherwise fails with AttributeErrors deep inside Trainer).

    Raises:
        UntestedVersionError: when one is outside its range and HF_FSDP2_ALLOW_UNTESTED is not 1.
    """
    found = untested(get_version)
    if not found:
        return
    message = "; ".join(f"{name} {v} is installed, hf_fsdp2 needs {range_text(name)}" for name, v in found.items())
    if os.environ.get(ALLOW_UNTESTED) == "1":
        warnings.warn(f"{message} (running anyway: {ALLOW_UNTESTED}=1).", stacklevel=2)
        return
    fix = " ".join(f"'{range_text(name)}'" for name in found)
    raise UntestedVersionError(
        f"{message}. Install a tested version (pip install {fix}), or set {ALLOW_UNTESTED}=1 to try it untested."
    )


@cache
def check_versions_once() -> None:
    """`check_versions` for the installed packages, once per process (the package's first use, a trainer's __init__)."""
    check_versions()
