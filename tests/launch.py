"""Run a worker script as N real processes (torchrun, gloo on CPU) or as one plain process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def run(
    script: str,
    nproc: int,
    *args: str,
    timeout: int = 600,
    expect_ok: bool = True,
    launcher_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run tests/workers/`script` on `nproc` ranks (nproc=0: plain python, no torchrun, world size 1);
    `launcher_args` go to torchrun (e.g. `--max-restarts=1`)."""
    path = os.path.join(WORKERS, script)
    if nproc == 0:
        command = [sys.executable, path, *args]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *launcher_args,
            path,
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def run_batch(
    script: str, nproc: int, runs: list[list[str]], workdir: str, timeout: int = 1200
) -> subprocess.CompletedProcess | None:
    """Run many invocations of a worker that accepts `--batch FILE` in one launch (one process group).

    A launch (interpreter, imports, rendezvous) costs more than a tiny training run, so tests plan their
    runs up front and start each world size once.
    """
    if not runs:
        return None
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"batch-{nproc}-{len(os.listdir(workdir))}.json")
    with open(path, "w") as f:
        json.dump(runs, f)
    return run(script, nproc, "--batch", path, timeout=timeout)


def load_result(out: str) -> dict[str, Any]:
    """Read the result.json rank 0 wrote."""
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)
