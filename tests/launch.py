"""Run a worker script as N real processes (a process group on gloo, CPU) or as one plain process.

Most runs start their ranks from a fork server that has already imported torch, transformers, peft and
hf_fsdp2: each rank is a real process with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
that joins its group over TCP like any torchrun worker, but it skips the ~5 s of imports every fresh
interpreter pays (measured here: a 4-step 2-rank run takes 10.6 s through torchrun, of which ~8 s is
starting interpreters). Runs that test torchrun itself (restarts, signals to its agent) or what a fresh
interpreter does at exit pass `torchrun=True` and get the real launcher.

Every worker, however launched, runs under the collective audit (tests/collective_audit.py): a rank that hands a
collective a tensor a GPU job would have on the wrong device fails with exit code 3 and the violations on stderr.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import multiprocessing
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
# What the fork server imports once; every rank it forks starts with these in memory.
PRELOAD = [
    "torch", "transformers.trainer", "peft", "datasets", "hf_fsdp2", "tests.workers.scenarios",
    "tests.collective_audit",
]  # fmt: skip
_context: Any = None


def run(
    script: str,
    nproc: int,
    *args: str,
    timeout: int = 600,
    expect_ok: bool = True,
    launcher_args: tuple[str, ...] = (),
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """Run tests/workers/`script` on `nproc` ranks (nproc=0: one plain process, world size 1).

    `torchrun=True` (implied by `launcher_args`, e.g. `--max-restarts=1`) launches through the real torchrun
    and fresh interpreters; otherwise the ranks come from the warm fork server.
    """
    path = os.path.join(WORKERS, script)
    # The checkout first; a PYTHONPATH already set stays behind it (packages installed with --target, on a GPU host).
    pythonpath = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}
    if torchrun or launcher_args:
        proc = _run_torchrun(path, nproc, args, launcher_args, env, timeout)
    else:
        proc = _run_forked(path, nproc, args, env, timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{_stderr_tail(proc)}"
        )
    return proc


def _stderr_tail(proc: subprocess.CompletedProcess, chars: int = 8000) -> str:
    """The end of each rank's stderr, the failed ranks first: a tail of the ranks' output joined would show only
    the last rank's, which is most often a peer's "connection reset", not the crash that caused it."""
    per_rank = getattr(proc, "rank_stderr", None)
    if per_rank is None:
        return proc.stderr[-chars:]
    # A rank that failed by itself first, then ranks the launcher terminated (-SIGTERM), then ranks that ended well.
    order = sorted(range(len(per_rank)), key=lambda r: (proc.rank_codes[r] == 0, proc.rank_codes[r] == -signal.SIGTERM))
    share = chars // len(per_rank)
    return "\n".join(
        f"--- rank {r} (exit code {proc.rank_codes[r]}) ---\n{_excerpt(per_rank[r], share)}" for r in order
    )


def _excerpt(stderr: str, chars: int) -> str:
    """The end of one rank's stderr, or from its native crash on (faulthandler's stack), without the list of
    extension modules faulthandler appends, which alone would fill the share."""
    crash = stderr.rfind("Fatal Python error")
    if crash >= 0:
        stderr = re.sub(r"\nExtension modules: .*", "", stderr[crash:])
        return stderr[:chars]
    return stderr[-chars:]


def _run_torchrun(
    path: str, nproc: int, args: tuple[str, ...], launcher_args: tuple[str, ...], env: dict, timeout: int
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N script args` (nproc=0: `python script args`), each process under the
    collective audit (`tests/audited_run.py`, a module torchrun and python run with `-m`)."""
    if nproc == 0:
        command = [sys.executable, "-m", "tests.audited_run", path, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        command += [*launcher_args, "-m", "tests.audited_run", path, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _fork_server() -> Any:
    """The fork-server context, started on first use with the heavy imports preloaded."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_forked(path: str, nproc: int, args: tuple[str, ...], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Start the ranks from the fork server; like torchrun, stop the others as soon as one rank fails."""
    context, world = _fork_server(), max(nproc, 1)
    port = _free_port()
    logs = tempfile.mkdtemp(prefix="hf_fsdp2_launch_")
    ranks = []
    for rank in range(world):
        rank_env = dict(env)
        if nproc > 0:
            rank_env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
            )  # fmt: skip
        out, err = os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err")
        process = context.Process(target=_rank_main, args=(path, list(args), rank_env, out, err), daemon=False)
        process.start()
        ranks.append(process)
    codes, timed_out = _wait(ranks, timeout)
    stdout = "".join(_read(os.path.join(logs, f"{r}.out")) for r in range(world))
    rank_stderr = [_read(os.path.join(logs, f"{r}.err")) for r in range(world)]
    stderr = "".join(rank_stderr)
    shutil.rmtree(logs, ignore_errors=True)  # the output now lives in the returned process record
    # The code of a rank that failed by itself, not of one the launcher stopped after it (-SIGTERM).
    failed = sorted((c for c in codes if c != 0), key=lambda c: c == -signal.SIGTERM)
    command = ["forked", f"--nproc={nproc}", path, *args]
    proc = subprocess.CompletedProcess(command, failed[0] if failed else 0, stdout, stderr)
    proc.rank_codes = codes  # what each rank exited with (torchrun prints these in its failure summary)
    proc.rank_stderr = rank_stderr
    if timed_out:  # what each rank had written by then is the only clue to where it hung
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=_stderr_tail(proc))
    return proc


def _wait(ranks: list, timeout: int) -> tuple[list[int], bool]:
    """Exit codes of every rank and whether time ran out; when one fails (or time runs out) the others are
    terminated, as torchrun does."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in ranks):
        if any(p.exitcode not in (None, 0) for p in ranks) or time.monotonic() > deadline:
            if time.monotonic() > deadline:  # each hung rank writes every thread's stack to its stderr first
                for p in ranks:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGUSR2)
                time.sleep(1)
            for p in ranks:
                if p.is_alive():
                    p.terminate()
            for p in ranks:
                p.join(10)
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in ranks:
        p.join()
    return [p.exitcode for p in ranks], time.monotonic() > deadline


def _read(path: str) -> str:
    """A rank's output file; empty when the rank died before it opened it."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def _rank_main(path: str, args: list[str], env: dict, out: str, err: str) -> None:
    """One rank, as `python script args` would run it: its environment, argv, output files, exit handlers.

    The worker runs under the collective audit (tests/collective_audit.py): a tensor it hands a collective on the
    wrong device for a GPU job fails the rank (exit code AUDIT_FAILED), with what and where on its stderr.
    """
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for stream, target in ((sys.stdout, out), (sys.stderr, err)):
        stream.flush()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, stream.fileno())
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Every Trainer.train() starts with a full gc.collect() (accelerate's free_memory); over the heap of the
    # preloaded modules it cost ~0.3 s a call, most of a tiny run (dropin_worker at 1 rank: 12.1 s, 4.4 s with
    # this). Those objects live as long as the process anyway: freezing leaves them out of every collection.
    gc.freeze()
    faulthandler.enable()  # a rank that crashes in native code leaves its Python stack in its stderr
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # and one that hangs, when the launcher times out
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    from tests.collective_audit import AUDIT_FAILED, audited, report

    sys.argv = [path, *args]
    code = 0
    with audited() as audit:
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    if audit.violations:
        print(report(audit), file=sys.stderr)
        code = code or AUDIT_FAILED
    if code == 0:
        atexit._run_exitfuncs()  # what the interpreter runs at a normal exit (hf_fsdp2 ends the group there)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


def load_runs(out: str, *names: str) -> dict[str, dict[str, Any]]:
    """Read the NAME.json files a batch of worker runs wrote under `out` (one per mode and world size), by name."""
    runs = {}
    for name in names:
        with open(os.path.join(out, f"{name}.json")) as f:
            runs[name] = json.load(f)
    return runs


def load_result(out: str) -> dict[str, Any]:
    """Read the result.json rank 0 wrote."""
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


# Modules a command-line call must not import: the training stack (and torchao, the qlora extra).
HEAVY_IMPORTS = (
    "transformers.modeling_utils", "transformers.trainer", "peft", "datasets", "accelerate", "trl", "torchao",
)  # fmt: skip


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m hf_fsdp2.cli ARGS` in a fresh interpreter; its last stdout line names the heavy modules it imported
    ("IMPORTED" alone when none)."""
    code = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('hf_fsdp2.cli', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        f"    print('IMPORTED', *[m for m in {HEAVY_IMPORTS!r} if m in sys.modules])\n"
    )
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
