"""`hf-fsdp2 env`: the versions and hardware a bug report needs, as markdown to paste into a GitHub issue.

It reads versions from the installed distributions (importlib.metadata) instead of importing the libraries, so it
stays fast and still reports an environment hf_fsdp2 would refuse; only torch is imported, for its CUDA build and
the accelerator. It knows nothing about training.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import torch

from . import __version__
from .versions import CHECKED, in_range, installed_version, range_text

# What a report names, in this order: the libraries hf_fsdp2 drives, then the optional extras (trl, qlora).
PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "torchao")
EXTRA_OF = {"trl": "trl", "torchao": "qlora"}


def package_rows(get_version: Callable[[str], str | None] = installed_version) -> list[tuple[str, str, str, str]]:
    """(package, installed version, tested range, in range?) for each of PACKAGES."""
    rows = []
    for name in PACKAGES:
        installed = get_version(name)
        tested = range_text(name)[len(name) :]
        if name in EXTRA_OF:
            tested += f" (`{EXTRA_OF[name]}` extra)"
        if installed is None:
            verdict = "**missing**" if name in CHECKED else "-"
        else:
            verdict = "yes" if in_range(name, installed) else "**no**"
        rows.append((name, installed or "not installed", tested, verdict))
    return rows


def torch_build() -> str:
    """torch's GPU build: its CUDA (and NCCL) or ROCm version, or that it is a CPU build."""
    if torch.version.cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
        return f"CUDA {torch.version.cuda}, NCCL {nccl}"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip}"
    return "CPU build"


def accelerator() -> str:
    """The accelerator torch sees and how many: 'cuda × 8 (NVIDIA H100 80GB HBM3)', or 'none (CPU only)'."""
    if not torch.accelerator.is_available():
        return "none (CPU only)"
    kind = torch.accelerator.current_accelerator().type
    count = torch.accelerator.device_count()
    module = torch.get_device_module(kind)
    name = module.get_device_name(0) if hasattr(module, "get_device_name") else kind
    return f"{kind} × {count} ({name})"


def report(get_version: Callable[[str], str | None] = installed_version) -> str:
    """The whole report, markdown."""
    lines = [
        "Copy and paste the text below into your GitHub issue (`hf-fsdp2 env`).",
        "",
        f"- hf_fsdp2: {__version__}",
        f"- Platform: {platform.platform()}",
        f"- Python: {platform.python_version()}",
        f"- torch build: {torch_build()}",
        f"- Accelerator: {accelerator()}",
        "",
        "| package | installed | tested range | in range |",
        "|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in package_rows(get_version)]
    return "\n".join(lines)
