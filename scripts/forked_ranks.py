"""Start the benchmark's processes as forks of one process that imported the workers' modules once.

Every run of the benchmark starts fresh Python processes (its ranks, then a consolidation tool), and each spent
~6.5 s importing torch, transformers' Trainer, Accelerate, peft and datasets before its clock started: ~1.5 of
the quick benchmark's ~6 minutes on 2 CPU cores, measuring nothing. On a host without an accelerator they are
forked instead from multiprocessing's fork server, which imports those modules once (`PRELOAD`); each child then
runs the same script with the same arguments and environment as the process it replaces (`runpy`), so every
measured phase starts from the same imported state as in a fresh process.

On an accelerator host every process is a fresh interpreter, as before: a process that has touched the
accelerator cannot be forked, and nothing here checks which import might.

As with any multiprocessing start method but fork, each child imports the launching script's main module first
(as `__mp_main__`): a driver script must keep its work under `if __name__ == "__main__":`, as benchmark.py does.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
from typing import Any

# What every worker imports before its clock starts; anything else (torchao for QLoRA, a consolidation tool's
# own modules) is imported in the child, before its baseline, exactly as in a fresh process.
PRELOAD = ["forked_ranks", "benchmark_worker", "benchmark_systems"]


FRESH_ENV = "BENCHMARK_FRESH_PROCESSES"  # "1": start every process as a fresh interpreter, as torchrun does


def can_fork() -> bool:
    """True on a host without an accelerator (the only kind forked ranks are used on), unless FRESH_ENV is "1"."""
    import torch

    return os.environ.get(FRESH_ENV) != "1" and not torch.accelerator.is_available()


def start(command: list[str], env: dict[str, str], log: str) -> Any:
    """Start `command` (`python script.py args...`) with `env`, its output going to the file `log`; return a
    handle with Popen's `poll()`, `kill()` and `returncode`."""
    if command[0] != sys.executable or not command[1].endswith(".py") or not can_fork():
        with open(log, "w") as out:
            return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    context = multiprocessing.get_context("forkserver")
    # NOTE: the server's libraries read some settings once, at import (OpenMP its thread count): it must start
    # with the environment its children get.
    os.environ.setdefault("OMP_NUM_THREADS", env.get("OMP_NUM_THREADS", "1"))
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=run_script, args=(command[1:], env, log), daemon=False)
    process.start()
    return ForkedProcess(process)


def run_script(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become `python argv...` with `env`, writing to `log`."""
    os.environ.clear()
    os.environ.update(env)
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


class ForkedProcess:
    """A forked child behind Popen's interface (what the launchers poll and kill)."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self.process = process

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.process.exitcode

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as Popen.kill does."""
        if self.process.exitcode is None:
            self.process.kill()

    def wait(self) -> int:
        """Wait for it to end; its exit code."""
        self.process.join()
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode
