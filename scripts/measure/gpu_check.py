"""The GPU check: everything we publish about GPUs, measured in one command on one lent GPU, most important first.

    python scripts/measure/gpu_check.py --wheels .whl --json $OUT/gpu.json   # on a lent GPU (past 15 min: use --parts)
    python scripts/measure/gpu_check.py --wheels .whl --parts compile,fp8,offload,planner --budget-s 540  # issue 63
    python scripts/measure/gpu_check.py --dry-run                            # the same code on the CPU, tiny sizes
    python scripts/measure/gpu_check.py --from-json scripts/results/gpu_h100.json   # print the docs table again
    python scripts/measure/gpu_check.py --fetch-wheels .whl          # here: the wheels a bare GPU image lacks

Parts, in the order they run (seconds each took on one H100 on 2026-11-27, imports included; the driver's
estimates):
    install      the project's requirements from --wheels (pip --no-index --target), torch left as the image has it
    build        a 100M Llama (fp32) and a 1B Llama of Llama-3.2-1B's shape (bf16), random weights, saved once
    collectives  every collective path of the package in a group of one, without the world-1 shortcut
                 (scripts/measure/collective_paths.py): NCCL gets every tensor a job of N GPUs would hand it  (~30)
    cuda_tests   pytest -m gpu on the suite's CUDA-only tests no other part measures (tests/test_muon.py: Muon's
                 Newton-Schulz and whole step bit-equal to torch's on cuBLAS; gpu_parts/cuda_tests.py)       (~30)
    two_ranks    2 ranks sharing the one GPU, each job against the same job in one process: full fine-tune fp32
                 and bf16, LoRA, QLoRA, cpu_offload with clipping (and a control: torch's own mesh must fail),
                 Muon, Adafactor, sequence parallelism, GRPO scored by a reward model, DPO, save -> resume ->
                 consolidate -> from_pretrained; tiny models (gpu_parts/two_ranks.py)                     (~120)
    switches     Liger and fp16 on CUDA (issue 61), each against plain Trainer with the same switch over the same
                 steps (gpu_parts/switches.py). 1B at throughput's sizes, bf16: FSDP2Trainer + Liger, Trainer + Liger,
                 and FSDP2Config(loss_chunk_size=4096) without Liger: losses against Trainer + Liger (bf16's 2%),
                 tokens/s, peak. 100M (fp32 weights), parity's 20 steps: FSDP2Trainer(fp16=True) against
                 Trainer(fp16=True) (autocast + GradScaler): losses within 0.25% of the largest (bf16's 2% over 8:
                 fp16's 10 mantissa bits round 8x finer), skipped (overflow) steps, loss scale, tokens/s. Liger comes
                 from --wheels; without it the Liger runs say "skipped: liger-kernel not installed". On the CPU
                 rehearsal both Liger runs are "skipped: no CUDA" and Trainer's fp16 computes in fp32        (~105)
    parity       100M, 20 steps: FSDP2Trainer against plain Trainer, bf16 (fp32 masters) and fp32             59
    throughput   1B, 4 x 2048 tokens, bf16: FSDP2Trainer, Trainer, Trainer + Accelerate's FSDP2 plugin, each
                 with and without activation checkpointing: tokens/s, MFU, peak max_memory_allocated         92
    compile      1B, no activation checkpointing, each system compiled by its own switch, side by side:
                 FSDP2Config(compile=True) (36 s alone), Trainer and Trainer + Accelerate's plugin with
                 TrainingArguments(torch_compile=True) (whole-model compiles); ratios to ours and to each
                 system's eager run (part throughput)                                                     (~180)
    fp8          Llama-3.2-3B's shape (built only for this part), activation checkpointing, compiled, 8 steps:
                 FSDP2Trainer bf16, FSDP2Config(float8=True), Trainer + Accelerate's FP8 via torchao
                 (gpu_parts/fp8.py): tokens/s, peak, losses against our bf16 (FP8_REL_TOLERANCE). On the CPU
                 rehearsal float8 is refused by name (recorded "skipped: no CUDA"), Accelerate's not tried  (~200)
    qlora        1B, activation checkpointing: LoRA r=16 on a bf16 base against QLoRA (NF4 base)              32
    long_rows    1B, one row of 16k and 32k tokens, with and without loss_chunk_size                          47
    offload      1B, activation checkpointing: cpu_offload=True against the same run on the GPU, each step
                 timed by phase (forward + backward, clip, optimizer step) and its last step profiled (H2D
                 and D2H copies); AdamW's step on the host: fused, foreach, for-loop (gpu_parts/offload.py)  (~55)
    generation   1B, 8 prompts x 128 tokens, 128 new: the gathered sharded model against the plain one, both
                 warmed up, then timed 3 times each in alternating order (medians)                          (~60)
    checkpoints  1B at throughput's step, on the workdir's disk (gpu_parts/checkpoints.py): async saves at steps 3,
                 6, 9 (each after the last write finished) and 10 (back to back): blocked in the save call plus the
                 wait for the host copy before the next optimizer step, each copy, buffers reused; two sync saves
                 (cached, then O_DIRECT writes) with their stages; the disk's write and cold-read rates for a file of
                 the checkpoint's size, and sync saves and a cold resume as fractions of them; consolidation  (~180)
    planner      `hf-fsdp2 plan` for a GPU against every measured FSDP2Trainer peak (goal: within 10%)        32

Each part is a module of `scripts/measure/gpu_parts/` (common.py holds what they share, report.py the tables); this
driver plans the runs, starts the workers and records what they return.

Results are written after every part (`--json`), so a run cut off by its time limit still leaves a file; a part
that would not finish inside `--budget-s` is skipped and says so. Each part's runs go to fresh worker processes
(one per system, so Accelerate's process-wide state never meets another system's); a worker writes each run's
figures as soon as it ends, so a crash or a time-out loses only the run in flight.

Part "two_ranks" launches twice: its one-process runs go to one plain process (no torchrun: a world of one), then
every job at 2 ranks to one `torchrun --nproc_per_node 2 -m hf_fsdp2.shared_device` launch: both ranks on cuda:0,
the job's group gloo registered for CUDA only, which routes tensors as NCCL does (a CPU tensor fails with NCCL's
error) and really exchanges them; NCCL itself refuses two ranks on one GPU. Same rows, same sums by construction: a
rank's batch of a step is one of the one process's two micro-batches (gradient accumulation), so fp32 gradients are
bit-equal and only sums over shards round apart (the CPU rehearsal: equal losses, weights 7.5e-9 apart, all of it the
grad norm's; bit-equal without clipping). After each job the ranks meet on a gloo group of their own: rank 0 holds the
job against the one-process record (the largest difference of losses, weights, log-probs, scores, each against its
tolerance, and the job's checks) and writes it; a rank left waiting 60 s for the other writes the job as failed and
ends the launch (the group is broken; the jobs after it are recorded as not run). On the CPU rehearsal the 2 ranks
are forked gloo ranks (with BENCHMARK_FRESH_PROCESSES=1 the torchrun command above, where the launcher only lets gloo
start); cpu_offload and the control are "skipped: no accelerator" there.

How things are measured: memory is torch.cuda.max_memory_allocated (reset after loading; on the CPU the
process's VmHWM above its start), step time the median of the steps after `warmup`, with the GPU synchronised
at every step's start and end; MFU = tokens/s x (6 N + 12 layers x hidden x seq) / the GPU's dense bf16 peak, N
the parameters that compute (a tied embedding counted once, as the head), attention not halved for causality
(torchtitan's convention). plain `Trainer` runs as a plain process (no process group), the FSDP2 systems as rank 0
of a world of one, as torchrun starts it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(SCRIPTS)
# The benchmark's systems, worker helpers and forked ranks, and the shared memory readings (imported by bare name).
IMPORTS = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common"), os.path.join(SCRIPTS, "measure")]
sys.path[:0] = IMPORTS

# Each part is its own module under gpu_parts/; this driver plans, launches and records them.
from gpu_parts.build import build  # noqa: E402
from gpu_parts.checkpoints import checkpoints  # noqa: E402
from gpu_parts.collectives import collectives  # noqa: E402
from gpu_parts.common import FP32_TOLERANCE, PEAK_BF16, free_memory, sizes  # noqa: E402, F401 (tests read FP32_TOLERANCE)
from gpu_parts.cuda_tests import cuda_tests  # noqa: E402
from gpu_parts.fp8 import fp8_run, plan_fp8  # noqa: E402
from gpu_parts.generation import generate  # noqa: E402
from gpu_parts.offload import host_adamw, offload_run, plan_offload  # noqa: E402
from gpu_parts.planner import measured_for_planner, planner  # noqa: E402
from gpu_parts.report import render_markdown  # noqa: E402
from gpu_parts.switches import LIGER_WHEEL, plan_switches, switched  # noqa: E402
from gpu_parts.training import train  # noqa: E402
from gpu_parts.two_ranks import plan_two_ranks, two_ranks  # noqa: E402

# Dense bf16 peak FLOP/s by GPU name (SXM parts; the H200 has the H100's compute).
PARTS = (
    *("collectives", "cuda_tests", "two_ranks", "switches", "parity", "throughput", "compile", "fp8", "qlora"),
    *("long_rows", "offload", "generation", "checkpoints", "planner"),
)
# Seconds each part took on one H100 (2026-11-27).
ESTIMATE_S = {"parity": 60, "throughput": 95, "compile": 40, "qlora": 35, "long_rows": 50, "offload": 35}
ESTIMATE_S |= {"generation": 60, "planner": 35, "collectives": 30}
# checkpoints, not measured yet (issue 63's version; the H200's two-save version took 128 s at 1 GB/s of writes): three
# trainers built (~13 s each), six 13.8 GiB writes (four async, waited for, and two sync: ~14 s each at the H200's
# 1 GB/s, less if O_DIRECT is faster), the disk yardstick (two 13.8 GiB writes and a read, ~30 s), a cold resume (~9 s)
# and consolidation (~5 s): ~180 s, less as saves approach the disk's rate.
ESTIMATE_S |= {"checkpoints": 180}
ESTIMATE_S |= {"two_ranks": 120}  # not measured yet: two launches' imports (~15 s each) and 23 tiny jobs
# Not measured yet: two workers' imports and first runs (~25 s each, as parity's), three 1B runs (~6 s each, as
# throughput's second runs) and Liger's Triton compilations (~20 s, a guess).
ESTIMATE_S |= {"switches": 105}
ESTIMATE_S |= {"cuda_tests": 30}  # not measured yet: pytest's start and torch's import (~15 s), three 256 x 512 steps
# Not measured yet (issue 63). compile: ours took 36 s alone; each peer is a worker of its own (imports ~12 s, loading
# ~6 s, 10 steps ~2 s) whose whole-model compile (16 blocks unrolled; Accelerate's broken at each block's FSDP hooks)
# is guessed at 45-50 s, against 8-10 s for ours (one block's graph, reused).
ESTIMATE_S |= {"compile": 180}
# fp8: two 3B runs in one worker (imports ~12 s; each: loading 6.4 GB ~12 s, compiling ~15 s, FP8's casts ~10 s more,
# 8 steps of ~0.5 s) and Accelerate's in another (fp32 weights loaded whole ~20 s, whole-model compile ~60 s); the 3B
# is built in part build (~30 s: initialised on the GPU, saved), which has no estimate.
ESTIMATE_S |= {"fp8": 200}
# offload: its 1B run took 32 s; now the same run on the GPU first (~8 s), one step more under the profiler (~5 s), and
# AdamW on the host over 200M parameters in three implementations (~10 s).
ESTIMATE_S |= {"offload": 55}
# A part whose ranks can wait on each other has a time limit of its own on a GPU: a job that leaves one rank in a
# collective would otherwise hold the loan until the whole budget is spent.
LIMIT_S = {"two_ranks": 300}
PLANNER_RESERVE_S = 35  # kept back for the planner, which compares what the other parts measured


def peer_backend(system: str, dry_run: bool) -> dict[str, str]:
    """The rehearsal compiles the peers' whole models with dynamo's aot_eager backend: the same switch and harness
    (TrainingArguments(torch_compile=True)), traced forward and backward, without inductor's C++ builds of kernels
    that are the peers' own (they took 28 of the part's 46 s with an empty kernel cache). Ours stays on inductor."""
    return {"backend": "aot_eager"} if dry_run and system != "hf_fsdp2" else {}


def plan_runs(dry_run: bool) -> dict[str, list[dict[str, Any]]]:
    """Every run of every part, as the workers receive them."""
    s = sizes(dry_run)["run"]
    big = dict(model="m1b", bf16=True, batch=s["batch"], seq=s["seq"], steps=s["steps"], warmup=3, lr=1e-5)
    parity = dict(model="m100", batch=4, seq=256 if not dry_run else 64, steps=20 if not dry_run else 6, warmup=1)
    parity |= dict(lr=1e-4, data="pattern")
    ac = dict(big, ac=True)
    long = [dict(ac, batch=1, seq=n, chunk=c, steps=3, warmup=1) for n in s["long"] for c in (None, s["chunk"])]
    return {
        "parity": [
            dict(parity, name=f"{system} {precision}", system=system, bf16=precision == "bf16")
            for precision in ("bf16", "fp32")
            for system in ("hf_fsdp2", "trainer")
        ],
        "throughput": [
            dict(cfg, name=f"{system}{' AC' if cfg.get('ac') else ''}", system=system)
            for cfg in (big, ac)
            for system in ("hf_fsdp2", "trainer", "accelerate")
        ],
        "compile": [
            dict(big, name=f"{system} compile", system=system, compile=True, **peer_backend(system, dry_run))
            for system in ("hf_fsdp2", "trainer", "accelerate")
        ],
        "fp8": plan_fp8(big),
        "qlora": [dict(ac, name=f"hf_fsdp2 {mode}", adapter=mode, lr=1e-4) for mode in ("lora", "qlora")],
        "long_rows": [dict(r, name=f"{r['seq']} tokens{' chunked' if r['chunk'] else ''}") for r in long],
        "offload": plan_offload(ac, dry_run),
        "collectives": [dict(name="collective paths", kind="collectives")],
        "cuda_tests": [dict(name="cuda tests", kind="cuda_tests")],
        "generation": [dict(model="m1b", name="generate", kind="generate", batch=8, prompt=128 if not dry_run else 16)],
        # throughput's step (4 x 2048 tokens): an async save's host copy overlaps a real step's forward and backward
        "checkpoints": [
            dict(model="m1b", name="checkpoints", kind="checkpoints", bf16=True, batch=s["batch"], seq=s["seq"])
        ],
        "planner": [dict(name="planner", kind="planner")],
        "two_ranks": plan_two_ranks(),
        "switches": plan_switches(big, parity, s["chunk"]),
    }


# ----------------------------------------------------------------------------------------------- the driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver (workers get --worker)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny sizes")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    parser.add_argument("--budget-s", type=float, default=470, help="stop starting parts after this (default 470)")
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_gpu_check")
    parser.add_argument("--json", default=None, help="default: scripts/results/gpu_<device>.json (dry run: workdir)")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--wheels", default=None, help="install the project's requirements from this folder first")
    parser.add_argument("--fetch-wheels", default=None, help="download the wheels --wheels needs into this folder")
    parser.add_argument("--from-json", default=None, help="print the table of a results file, run nothing")
    parser.add_argument(
        "--keep", default=None, help="a results file whose finished parts are kept (and not run again): a second call"
    )
    parser.add_argument(
        "--runs",
        default=None,
        help="comma-separated names of the runs to do of the chosen parts (two_ranks: 'JOB' at 2 ranks, held against "
        "the record 'JOB (one process)' left in the workdir; 'JOB (one process)' for that run)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a file of runs to do
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.from_json:
        with open(args.from_json) as f:
            return print(render_markdown(json.load(f)))
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels)
    run_check(args)


def run_check(args: argparse.Namespace) -> dict:
    """Run the parts in order inside the time budget, writing the results after each."""
    started = time.perf_counter()
    os.makedirs(args.workdir, exist_ok=True)
    env = worker_env(args)
    results: dict[str, Any] = {"parts": {}, "dry_run": args.dry_run, "budget_s": args.budget_s}
    if args.wheels:
        results["parts"]["install"] = timed_part(lambda: install_wheels(args.wheels, args.workdir, env))
    results["parts"]["build"] = timed_part(lambda: run_workers(args, env, "build", build_runs(args), 600))
    results["environment"] = results["parts"]["build"].pop("environment", {})
    json_path = args.json or default_json(args, results["environment"])
    write(results, json_path, started)
    wanted = args.parts.split(",")
    if args.keep:  # a second call: keep what the first finished, record where each part came from
        with open(args.keep) as f:
            kept = json.load(f)
        results["earlier_calls_wall_s"] = [*kept.get("earlier_calls_wall_s", []), kept.get("wall_s")]
        for part, outcome in kept["parts"].items():
            if part in PARTS and outcome.get("status") == "ok":
                results["parts"][part] = {**outcome, "call": outcome.get("call", len(results["earlier_calls_wall_s"]))}
                wanted = [p for p in wanted if p != part]
    runs = plan_runs(args.dry_run)
    for part in [p for p in PARTS if p in wanted and p not in results["parts"]]:
        left = args.budget_s - (time.perf_counter() - started) - (0 if part == "planner" else PLANNER_RESERVE_S)
        if not args.dry_run and left < ESTIMATE_S[part]:
            results["parts"][part] = {
                "status": f"skipped: {left:.0f} s left of the budget, ~{ESTIMATE_S[part]} s needed"
            }
        else:
            part_runs = [dict(r, part=part) for r in runs[part] if chosen(args, r)]
            if part == "planner":
                part_runs[0]["measured"] = measured_for_planner(results)
            timeout = max(left, 30) if args.dry_run else min(max(left, 30), LIMIT_S.get(part, left))
            todo = functools.partial(run_workers, args, env, part, part_runs, timeout)
            results["parts"][part] = timed_part(todo)
        print(f"[{time.perf_counter() - started:5.0f} s] {part}: {results['parts'][part]['status']}", flush=True)
        write(results, json_path, started)
    table = render_markdown(results)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    print(f"results: {json_path}")
    return results


def chosen(args: argparse.Namespace, run: dict) -> bool:
    """Whether --runs keeps a run."""
    return args.runs is None or run["name"] in args.runs.split(",")


def timed_part(fn: Any) -> dict:
    """Run one part; its status, seconds and whatever it returned."""
    start = time.perf_counter()
    try:
        outcome = fn()
        status = "ok" if all("error" not in r for r in outcome.get("runs", {}).values()) else "failed runs"
    except Exception as error:  # noqa: BLE001 - a part's failure is recorded, the next part still runs
        outcome, status = {"error": f"{type(error).__name__}: {error}"[-3000:]}, "failed"
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), **outcome}


def write(results: dict, path: str, started: float) -> None:
    """Write the results so far (atomically: a run cut off mid-write keeps the previous file)."""
    results["wall_s"] = round(time.perf_counter() - started, 1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def default_json(args: argparse.Namespace, environment: dict) -> str:
    """scripts/results/gpu_<device>.json on a GPU (device: h100, h200, ...); the workdir for a dry run."""
    if args.dry_run:
        return os.path.join(args.workdir, "gpu_dry_run.json")
    name = environment.get("device_name", "unknown")
    slug = next((key.lower() for key in PEAK_BF16 if key in name), "".join(c for c in name.lower() if c.isalnum()))
    return os.path.join(SCRIPTS, "results", f"gpu_{slug}.json")


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment: this checkout (and the installed wheels) first on the path."""
    path = [os.path.join(args.workdir, "site")] if args.wheels else []
    path += [ROOT, *IMPORTS, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "TOKENIZERS_PARALLELISM": "false"}
    env |= {"HF_HUB_OFFLINE": "1", "GPU_CHECK_WORKDIR": args.workdir, "GPU_CHECK_DRY_RUN": str(int(args.dry_run))}
    if args.dry_run:
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return env


def install_wheels(folder: str, workdir: str, env: dict) -> dict:
    """pip install the folder's wheels into workdir/site (no index, no dependency resolution: torch stays the
    image's, whose CUDA build cannot travel)."""
    wheels = sorted(os.path.join(folder, w) for w in os.listdir(folder) if w.endswith(".whl"))
    target = os.path.join(workdir, "site")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    subprocess.run([*command, "--target", target, *wheels], check=True, env=env)
    return {"wheels": [os.path.basename(w) for w in wheels]}


def fetch_wheels(folder: str) -> None:
    """Download (on a machine with the package registry) the wheels a bare GPU image needs: every requirement of
    the package but torch (hf_fsdp2/requirements/core.txt), and the qlora extra, at the versions installed here, for
    the image's Python 3.12; and liger-kernel for part "switches", pinned there (Triton-only, so not installed here)."""
    from importlib.metadata import version

    lines = []
    for name in ("core.txt", "qlora.txt"):
        with open(os.path.join(ROOT, "hf_fsdp2", "requirements", name)) as f:
            lines += [line.split("#", 1)[0] for line in f]
    names = [line.split(">")[0].split("=")[0].split("<")[0].strip() for line in lines if line.strip()]
    # datasets' pins the image may not meet; huggingface_hub and tokenizers are left as the image has them.
    names += ["dill", "multiprocess", "fsspec", "regex"]
    names += ["pytest", "pluggy", "iniconfig"]  # part "cuda_tests" runs pytest
    pins = [f"{name}=={version(name)}" for name in names if name != "torch"] + [LIGER_WHEEL]
    platforms = [f"--platform=manylinux_{v}_x86_64" for v in ("2_28", "2_24", "2_17")] + [
        "--platform=manylinux2014_x86_64"
    ]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version=3.12"]
    subprocess.run([*command, "--implementation=cp", *platforms, "-d", folder, *pins], check=True)


def build_runs(args: argparse.Namespace) -> list[dict]:
    """The one run of the build part: save the models the chosen parts train (the 3B only for part fp8)."""
    models = ["m100", "m1b", *(["m3b"] if "fp8" in args.parts.split(",") else [])]
    return [{"name": "build", "kind": "build", "part": "build", "models": models}]


def run_workers(args: argparse.Namespace, env: dict, part: str, runs: list[dict], timeout: float) -> dict:
    """Run a part's runs in one worker process per system, in order; collect each run's figures."""
    done: dict[str, Any] = {}
    deadline = time.perf_counter() + timeout
    for system in dict.fromkeys(r.get("system", "hf_fsdp2") for r in runs):
        todo = [r for r in runs if r.get("system", "hf_fsdp2") == system]
        jobs = os.path.join(args.workdir, f"jobs-{part}-{system}.json")
        out = os.path.join(args.workdir, f"out-{part}-{system}.jsonl")
        with open(jobs, "w") as f:
            json.dump(todo, f)
        if os.path.exists(out):
            os.remove(out)
        log = os.path.join(args.workdir, f"log-{part}-{system}.txt")
        launch(system, jobs, env, log, max(deadline - time.perf_counter(), 5))
        finished = read_jsonl(out)
        for run in todo:
            done[run["name"]] = finished.get(run["name"]) or {"error": "worker ended before this run: " + tail(log)}
    environment = next((r.pop("environment") for r in done.values() if "environment" in r), None)
    return {"runs": done, **({"environment": environment} if environment else {})}


def launch(system: str, jobs: str, env: dict, log: str, timeout: float) -> None:
    """One worker process: plain Trainer and the one-process runs of "two_ranks" as a plain process, the FSDP2 systems
    as rank 0 of a world of one; or the 2 ranks of "two_ranks" (`start_two_ranks`).

    On the CPU rehearsal it is forked from a process that imported torch, transformers and the systems once
    (scripts/benchmark/forked_ranks.py: 13 fresh workers spent about half of the dry run importing); on a GPU it starts
    fresh, as a process that touched the GPU cannot be forked.
    """
    command = [sys.executable, os.path.abspath(__file__), "--worker", jobs]
    if system == "two_ranks":
        return wait_for(start_two_ranks(command, env, log), timeout, log)
    import forked_ranks

    env = dict(env)
    if system not in ("trainer", "one_process"):
        env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if env["GPU_CHECK_DRY_RUN"] == "1":
        process = forked_ranks.start(command, env, log)
    else:
        with open(log, "w") as output:
            process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    wait_for([process], timeout, log)


def start_two_ranks(command: list[str], env: dict, log: str) -> list[Any]:
    """The worker as 2 ranks on the one GPU: `torchrun --nproc_per_node 2 -m hf_fsdp2.shared_device` (gloo for CUDA
    tensors under NCCL's device rules). The CPU rehearsal starts it the same way (there that launcher only lets
    torchrun's gloo start): one launch, so forking would save two imports, and the launch a GPU gets stays rehearsed.
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    torchrun += ["-m", "hf_fsdp2.shared_device", *command[1:]]
    with open(log, "w") as output:
        output.write(f"[gpu_check] {' '.join(torchrun)}\n")
        output.flush()
        return [subprocess.Popen(torchrun, env=env, stdout=output, stderr=subprocess.STDOUT)]


def wait_for(processes: list[Any], timeout: float, log: str) -> None:
    """Wait for a worker's processes; when one fails, or at the time limit, stop the others (as torchrun does)."""
    deadline = time.perf_counter() + timeout
    while any(p.poll() is None for p in processes) and time.perf_counter() < deadline:
        if any(p.poll() not in (None, 0) for p in processes):
            break
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            stop(process)
            with open(log, "a") as output:
                output.write(f"\n[gpu_check] worker stopped at its time limit ({timeout:.0f} s) or a rank's failure\n")


def stop(process: Any) -> None:
    """Kill a worker; torchrun is asked first (SIGTERM), so that it stops its ranks (within its own 30 s) and
    leaves none behind."""
    if isinstance(process, subprocess.Popen) and "torch.distributed.run" in process.args:
        process.terminate()
        try:
            process.wait(timeout=40)
            return
        except subprocess.TimeoutExpired:
            pass
    process.kill()


def free_port() -> int:
    """A free TCP port for a world of one's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: str) -> dict[str, Any]:
    """The runs a worker finished, by name."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {row["name"]: row for row in rows}


def tail(path: str, chars: int = 2500) -> str:
    """The end of a worker's log, for a run it did not finish."""
    with open(path) as f:
        return f.read()[-chars:]


# ----------------------------------------------------------------------------------------------- the workers


def worker(jobs_path: str) -> None:
    """Do each run of the jobs file in this process, appending its figures to the part's JSONL as it ends."""
    with open(jobs_path) as f:
        jobs = json.load(f)
    out = jobs_path.replace("jobs-", "out-").replace(".json", ".jsonl")
    with cpu_attention():
        run_jobs(jobs, out)
    import torch.distributed as dist

    if dist.is_initialized():  # a forked worker's exit runs no atexit handlers (scripts/benchmark/forked_ranks.py)
        dist.destroy_process_group()


def cpu_attention() -> Any:
    """On the CPU rehearsal, attention through sdpa's math kernel: torch 2.13's CPU flash kernel fails in bf16 on a
    CPU without AVX-512 ('pack_vnni2 is only supported when avx512 is supported'); on a GPU, sdpa chooses."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return contextlib.nullcontext() if torch.cuda.is_available() else sdpa_kernel([SDPBackend.MATH])


def run_jobs(jobs: list[dict], out: str) -> None:
    """Do each run, appending its figures to the part's JSONL as it ends."""
    for spec in jobs:
        start = time.perf_counter()
        try:
            record = RUNNERS[spec.get("kind", "train")](spec)
        except Exception as error:  # noqa: BLE001 - recorded; the part's next run still gets its chance
            traceback.print_exc()
            record = {"error": f"{type(error).__name__}: {error}"[-2000:]}
        record |= {"name": spec["name"], "spec": spec, "seconds": round(time.perf_counter() - start, 1)}
        free_memory()
        # At 2 ranks (part "two_ranks") rank 0 writes the job's record; or the rank that found the group broken (the
        # other is stuck in a collective), which then ends the worker: torchrun stops the stuck rank.
        broken = record.pop("group_broken", False)
        if os.environ.get("RANK", "0") == "0" or broken:
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
        print(f"[gpu_check] {spec['part']}: {spec['name']} done in {record['seconds']} s", flush=True)
        if broken:
            os._exit(1)  # NOTE: no exit handlers: they would wait in a barrier on the broken group


RUNNERS = {
    "collectives": collectives,
    "cuda_tests": cuda_tests,
    "train": train,
    "generate": generate,
    "checkpoints": checkpoints,
    "planner": planner,
    "build": build,
    "two_ranks": two_ranks,
    "switches": switched,
    "fp8": fp8_run,
    "offload": offload_run,
    "host_adamw": host_adamw,
}


# ----------------------------------------------------------------------------------------------- the report


if __name__ == "__main__":
    main()
