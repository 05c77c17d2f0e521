"""How the benchmark runs a system: one process group of ranks (forked, or fresh interpreters), one consolidation
tool in a fresh process, the uncounted warm-up and the page-cache read-through; and which systems there are.

`benchmark.py` (the quick benchmark) and `benchmark_sweep.py` (the size sweep) both run systems through this module;
neither imports the other's runner, so the two scripts import each other nowhere. The ranks themselves run
`benchmark.py --worker ...` (`benchmark_worker.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forked_ranks  # noqa: E402
from benchmark_worker import START_DIR_ENV  # noqa: E402

# The script each rank and consolidation process runs (its --worker mode).
BENCHMARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark.py")
SYSTEMS = (
    *("hf_fsdp2", "hf_fsdp2_async", "accelerate_fsdp2", "transformers_fsdp2", "ddp"),
    *("hf_fsdp2_lora", "hf_fsdp2_qlora"),
)
ADAPTER_SYSTEMS = ("hf_fsdp2_lora", "hf_fsdp2_qlora")
# Systems whose resume is not measured: a variant differing only in how checkpoints are written, and one
# that cannot resume at all. Only sharded checkpoints need consolidating.
NO_RESUME = {"hf_fsdp2_async", "transformers_fsdp2"}
CONSOLIDATES = ("hf_fsdp2", "accelerate_fsdp2")
# The command each system's users type to consolidate, timed from its start to its exit (imports included).
CONSOLIDATION_COMMANDS = {
    "hf_fsdp2": lambda checkpoint, output: ["-m", "hf_fsdp2.cli", "consolidate", checkpoint, output],
    "accelerate_fsdp2": lambda checkpoint, output: [
        *("-m", "accelerate.commands.accelerate_cli", "merge-weights"),
        *(os.path.join(checkpoint, "pytorch_model_fsdp_0"), output),
    ],
}


def _run_fresh(command: list[str]) -> None:
    """Run `command` as a fresh interpreter (see forked_ranks); fail loudly with its output if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run failed: {' '.join(command)}\n{proc.stdout[-6000:]}")


def _run(command: list[str], result: str) -> dict:
    """Run one measurement process, a fresh interpreter; return what it wrote to `result`."""
    _run_fresh(command)
    with open(result) as f:
        return json.load(f)


def _worker_options(args: argparse.Namespace) -> list[str]:
    """Options every worker needs to build the same run as the others."""
    options = [
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq-len",
        str(args.seq_len),
        "--vocab",
        str(args.vocab),
        "--samples",
        str(args.samples),
        "--warmup",
        str(args.warmup),
    ]
    options += ["--optim", args.optim] if getattr(args, "optim", None) else []
    return options + ([] if args.resume else ["--no-resume"])


def run_training(args: argparse.Namespace, system: str, model_path: str, tag: str) -> dict:
    """One torchrun process group: load, train with saves, resume; returns rank 0's JSON."""
    run_dir = os.path.join(args.workdir, f"run-{system}")
    shutil.rmtree(run_dir, ignore_errors=True)
    # NOTE: the previous run's checkpoints may still be on their way to disk; the kernel's write-back then
    # competes with this run's load for the 2 cores (measured: hf_fsdp2 loaded in 1.06 s right after DDP,
    # which writes two 1.1 GB checkpoints, and in 0.55-0.57 s after the other systems).
    os.sync()
    result = os.path.join(args.workdir, f"result-{system}-{tag}.json")
    command = [
        sys.executable,
        BENCHMARK,
        "--worker",
        "train",
        "--system",
        system,
        "--model-path",
        model_path,
        "--run-dir",
        run_dir,
        "--result",
        result,
        *_worker_options(args),
    ]
    if system in NO_RESUME:
        command.append("--no-resume")
    return _run_ranks(command, args.nproc, result)


def _run_ranks(command: list[str], nproc: int, result: str) -> dict:
    """Run `command` as ranks 0..nproc-1 of one process group on this machine, as torchrun would start them.

    NOTE: started directly, not through torchrun: its agent added ~2 s per run (importing torch, rendezvous,
    teardown) to the benchmark's wall time and nothing to any measured phase, which start inside the ranks.
    Like torchrun's agent, this process hosts the rendezvous store before the ranks start and they connect to it
    (TORCHELASTIC_USE_AGENT_STORE). Otherwise rank 0 starts the store inside the first process group's creation,
    a rank that connects before it listens retries after a back-off, and the process group took 0.48-0.55 s
    instead of 2-5 ms in 2 of 10 launches of two ranks started together (0.3-0.7 s in 4 of 12 in another
    try): a random half second in one system's load or another's, which torchrun users never pay.
    On a host without an accelerator the ranks are forked from a process that imported their modules once
    (`forked_ranks`): torchrun's ranks each import them, which no phase measures.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc)}
    base.update(LOCAL_WORLD_SIZE=str(nproc), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    base.update(TORCHELASTIC_USE_AGENT_STORE="True")
    with tempfile.TemporaryDirectory(prefix="benchmark-start-") as start, tempfile.TemporaryDirectory() as logged:
        base[START_DIR_ENV] = start
        logs = [os.path.join(logged, f"rank{r}.log") for r in range(nproc)]
        for log in logs:  # a rank that dies before opening its log still has one to read
            open(log, "w").close()
        ranks = [
            forked_ranks.start(command, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, log)
            for r, log in enumerate(logs)
        ]
        while any(rank.poll() is None for rank in ranks):
            if any(rank.poll() not in (None, 0) for rank in ranks):  # a failed rank leaves the others waiting
                for rank in ranks:
                    rank.kill()
            time.sleep(0.05)
        if any(rank.poll() != 0 for rank in ranks):
            output = ""
            for r, log in enumerate(logs):
                with open(log) as f:
                    output += f"--- rank {r} (exit {ranks[r].poll()}) ---\n{f.read()[-4000:]}\n"
            raise RuntimeError(f"benchmark run failed: {' '.join(command)}\n{output}")
    with open(result) as f:
        return json.load(f)


def run_consolidation(args: argparse.Namespace, system: str, checkpoint: str, tag: str) -> dict:
    """One fresh process running the system's own consolidation tool on its last checkpoint."""
    output = os.path.join(args.workdir, f"consolidated-{system}")
    shutil.rmtree(output, ignore_errors=True)
    # Flush earlier runs' dirty pages first: a tool that skips fsync would otherwise leave its disk writes
    # to be paid for by whichever tool runs next.
    os.sync()
    result = os.path.join(args.workdir, f"consolidate-{system}-{tag}.json")
    command = [
        sys.executable,
        BENCHMARK,
        "--worker",
        "consolidate",
        "--system",
        system,
        "--checkpoint",
        checkpoint,
        "--output",
        output,
        "--result",
        result,
    ]
    measured = _run(command, result)
    measured["command_s"] = time_consolidation_command(system, checkpoint, output + "-command")
    return measured


def time_consolidation_command(system: str, checkpoint: str, output: str) -> float:
    """Seconds from starting the system's consolidation command to its exit, what its user waits for: the
    in-process time above leaves out the interpreter's start and the tool's imports."""
    shutil.rmtree(output, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    _run_fresh([sys.executable, *CONSOLIDATION_COMMANDS[system](checkpoint, output)])
    seconds = time.perf_counter() - start
    shutil.rmtree(output, ignore_errors=True)
    return seconds


def warm_up(args: argparse.Namespace, system: str, model_path: str) -> None:
    """One short run of `system` that is not counted: the machine's first run pays what later runs do not.

    NOTE: measured, the first run of a benchmark loaded 2x slower than the same loading's later runs (hf_fsdp2,
    always run first: 1.36 s, then 0.66 s in its second run; hf_fsdp2_async, run next: 0.56-0.65 s), with the
    weights already in the page cache and the ranks starting their clocks together. Its cause was not traced;
    one uncounted run keeps it out of every system's figures.
    """
    print(f"warm-up: one uncounted run of {system}", flush=True)
    short = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0, "resume": False})
    run_training(short, system, model_path, "warmup")


def read_through(folder: str) -> None:
    """Read every file under `folder` once, so that every system's load finds the weights in the page cache.

    NOTE: without it the first run of the benchmark alone read them from disk (measured: hf_fsdp2, always run
    first, loaded in 1.30-1.49 s in its first run, 0.64-0.83 s in its second).
    """
    for directory, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                while f.read(1 << 24):
                    pass
