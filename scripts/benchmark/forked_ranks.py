"""Start the benchmark's processes as forks of one process that imported the workers' modules once.

Every run of the benchmark starts fresh Python processes (its ranks, then a consolidation tool), and each spent
~6.5 s importing torch, transformers' Trainer, Accelerate, peft and datasets before its clock started: about 3 of
the quick benchmark's 6.2 minutes on 2 CPU cores (measured 2026-11-26), measuring nothing. On a host without an
accelerator they are forked instead from multiprocessing's fork server, which imports those modules once
(`PRELOAD`); each child then runs the same script with the same arguments and environment as the process it
replaces (`runpy`), so every measured phase starts from the same imported state as in a fresh process.

Two things a fork shares that a fresh process owns, each measured and undone before the child's clock starts:
- the server's Python heap, copied page by page on first write: Trainer's `gc.collect()` at the start of
  `train()` writes to every tracked object, so a forked load took ~0.1 s longer (hf_fsdp2 0.60-0.64 s against
  0.43-0.55 s fresh, 3 interleaved pairs) until the child ran one collection first;
- the libraries' file-backed pages the imports touched: a fork does not copy their page-table entries, so the
  child's resident memory grew by them during its first phase (load peaks 214-217 against 201 MiB fresh, 294
  against 282 MiB for native loading) until the child maps the pages the server had resident
  (`MADV_POPULATE_READ`, from the server's `/proc/self/pagemap` taken after its imports).
One difference stayed: a forked `hf_fsdp2.consolidate` peaked at 72-82 MiB against 66-70 MiB fresh (Accelerate's
tool 442-444 MiB either way), from heap state the child inherits; so the benchmark starts its consolidation tools
fresh (4 processes in a quick run).

On an accelerator host every process is a fresh interpreter, as before: a process that has touched the
accelerator cannot be forked, and nothing here checks which import might.

A process has one fork server: where another was started first (the test suite's, tests/launch.py), its children
import the workers' modules themselves, before their clocks, as fresh processes do. As with any multiprocessing
start method but fork, each child imports the launching script's main module first
(as `__mp_main__`): a driver script must keep its work under `if __name__ == "__main__":`, as benchmark.py does.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
from typing import Any

import numpy as np

# What every worker imports before its clock starts; anything else (torchao for QLoRA, a consolidation tool's
# own modules) is imported in the child, before its baseline, exactly as in a fresh process.
# forked_ranks comes last: importing it in the server records what the imports before it left resident.
PRELOAD = ["benchmark_worker", "benchmark_systems", "forked_ranks"]
SERVER_ENV = "FORKED_RANKS_SERVER"  # set only while the fork server starts
# Pages per pagemap read: each buffer stays below glibc's initial mmap threshold (128 KiB), so reading the map
# cannot raise that threshold (a mapped block's free raises it for good) in the server and so in every child.
# A precaution: with one read per mapping, the forked consolidation's extra peak was the same.
PAGEMAP_CHUNK = 8192
MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages as a read of each would
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
    if not _server_started:
        _start_server(context, env)
    process = context.Process(target=run_script, args=(command[1:], env, log), daemon=False)
    process.start()
    return ForkedProcess(process)


_server_started = False


def _start_server(context: Any, env: dict[str, str]) -> None:
    """Start the fork server with PRELOAD imported and the environment its children will have."""
    global _server_started
    # NOTE: the server's libraries read some settings once, at import (OpenMP its thread count): it must start
    # with the environment its children get.
    os.environ.setdefault("OMP_NUM_THREADS", env.get("OMP_NUM_THREADS", "1"))
    # NOTE: Python 3.11's fork server is started with `python -c`, so it finds modules from the current folder,
    # not from this script's: without this, PRELOAD failed silently (ImportError is skipped) outside scripts/.
    here = os.path.dirname(os.path.abspath(__file__))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, paths)])
    context.set_forkserver_preload(PRELOAD)
    os.environ[SERVER_ENV] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[SERVER_ENV]
    _server_started = True


def resident_file_pages() -> list[tuple[int, int]]:
    """(address, length) of every run of this process's file-backed pages that are mapped in memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or fields[4] == "0" or not fields[1].startswith("r"):
                continue  # anonymous (a fork copies those mappings' entries) or unreadable
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for first in range(start, end, PAGEMAP_CHUNK * page):
                count = min(PAGEMAP_CHUNK, (end - first) // page)
                raw = os.pread(pagemap.fileno(), count * 8, first // page * 8)
                present = np.concatenate([[0], np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63), [0]])
                edges = np.flatnonzero(np.diff(present.astype(np.int8)))
                for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                    address, length = first + a * page, (b - a) * page
                    if runs and runs[-1][0] + runs[-1][1] == address:  # a run that crosses chunks
                        address, length = runs[-1][0], runs.pop()[1] + length
                    runs.append((address, length))
    return runs


def map_like_server(runs: list[tuple[int, int]]) -> None:
    """Map the pages the server had resident, as a fresh process that imported the same modules has them."""
    libc = ctypes.CDLL(None, use_errno=True)
    for address, length in runs:
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_READ)  # best effort


# In the fork server, after the other PRELOAD modules: what the imports left resident, inherited by every child.
SERVER_RESIDENT = resident_file_pages() if os.environ.get(SERVER_ENV) == "1" else []


def run_script(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become `python argv...` with `env`, writing to `log`.

    Unlike an interpreter's, its exit runs no atexit handlers (multiprocessing ends a child with os._exit): the
    benchmark's workers end their process groups themselves.
    """
    os.environ.clear()
    os.environ.update(env)
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    sys.argv = list(argv)
    gc.collect()  # writes to every tracked object: copies the shared heap's pages now, not in a measured phase
    map_like_server(SERVER_RESIDENT)
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
