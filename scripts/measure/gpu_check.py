"""The GPU check: everything we publish about GPUs, measured in one command on one lent GPU, most important first.

    python scripts/measure/gpu_check.py --wheels .whl --json $OUT/gpu.json   # on a lent GPU (about 8 min)
    python scripts/measure/gpu_check.py --dry-run                            # the same code on the CPU, tiny sizes
    python scripts/measure/gpu_check.py --from-json scripts/results/gpu_h100.json   # print the docs table again
    python scripts/measure/gpu_check.py --fetch-wheels .whl          # here: the wheels a bare GPU image lacks

Parts, in the order they run (seconds each took on one H100 on 2026-11-27, imports included; the driver's
estimates):
    install      the project's requirements from --wheels (pip --no-index --target), torch left as the image has it
    build        a 100M Llama (fp32) and a 1B Llama of Llama-3.2-1B's shape (bf16), random weights, saved once
    parity       100M, 20 steps: FSDP2Trainer against plain Trainer, bf16 (fp32 masters) and fp32             59
    throughput   1B, 4 x 2048 tokens, bf16: FSDP2Trainer, Trainer, Trainer + Accelerate's FSDP2 plugin, each
                 with and without activation checkpointing: tokens/s, MFU, peak max_memory_allocated         92
    compile      1B: FSDP2Config(compile=True), no activation checkpointing                                  36
    qlora        1B, activation checkpointing: LoRA r=16 on a bf16 base against QLoRA (NF4 base)              32
    long_rows    1B, one row of 16k and 32k tokens, with and without loss_chunk_size                          47
    offload      1B, activation checkpointing, cpu_offload=True (against the throughput part's run)          32
    generation   1B, 8 prompts x 128 tokens, 128 new: the gathered sharded model against the plain one         30
    checkpoints  1B: sync and async save blocked time, resume, consolidation, on the workdir's disk   (~90)
    planner      `hf-fsdp2 plan` for a GPU against every measured FSDP2Trainer peak (goal: within 10%)        32

Results are written after every part (`--json`), so a run cut off by its time limit still leaves a file; a part
that would not finish inside `--budget-s` is skipped and says so. Each part's runs go to fresh worker processes
(one per system, so Accelerate's process-wide state never meets another system's); a worker writes each run's
figures as soon as it ends, so a crash or a time-out loses only the run in flight.

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
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(SCRIPTS)
# The benchmark's systems, worker helpers and forked ranks, and the shared memory readings (imported by bare name).
IMPORTS = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common")]
sys.path[:0] = IMPORTS

# Dense bf16 peak FLOP/s by GPU name (SXM parts; the H200 has the H100's compute).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "B200": 2250e12}
PARTS = (
    *("parity", "throughput", "compile", "qlora", "long_rows", "offload", "generation", "checkpoints"),
    "planner",
)
# Seconds each part took on one H100 (2026-11-27); checkpoints: its failed first try took 90.
ESTIMATE_S = {"parity": 60, "throughput": 95, "compile": 40, "qlora": 35, "long_rows": 50, "offload": 35}
ESTIMATE_S |= {"generation": 30, "checkpoints": 90, "planner": 35}
PLANNER_RESERVE_S = 35  # kept back for the planner, which compares what the other parts measured
BF16_REL_TOLERANCE = 0.02  # bf16 rounds to 2^-8 relative: 20 steps of two different bf16 programs stay within 2%
FP32_TOLERANCE = 1e-5


def sizes(dry_run: bool) -> dict[str, dict[str, Any]]:
    """The models and row lengths of each part: real ones on a GPU, tiny ones for the CPU rehearsal."""
    if dry_run:
        small = dict(hidden=64, layers=2, heads=4, kv=2, inter=128, vocab=512, tied=True, dtype="float32")
        big = dict(hidden=64, layers=2, heads=4, kv=2, inter=256, vocab=1024, tied=True, dtype="bfloat16")
        return {"m100": small, "m1b": big, "run": dict(batch=2, seq=64, long=(128, 256), chunk=64, steps=4)}
    small = dict(hidden=768, layers=12, heads=12, kv=4, inter=2048, vocab=16000, tied=True, dtype="float32")
    big = dict(hidden=2048, layers=16, heads=32, kv=8, inter=8192, vocab=128256, tied=True, dtype="bfloat16")
    return {"m100": small, "m1b": big, "run": dict(batch=4, seq=2048, long=(16384, 32768), chunk=4096, steps=10)}


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
        "compile": [dict(big, name="hf_fsdp2 compile", compile=True)],
        "qlora": [dict(ac, name=f"hf_fsdp2 {mode}", adapter=mode, lr=1e-4) for mode in ("lora", "qlora")],
        "long_rows": [dict(r, name=f"{r['seq']} tokens{' chunked' if r['chunk'] else ''}") for r in long],
        "offload": [dict(ac, name="hf_fsdp2 AC cpu_offload", offload=True, steps=4, warmup=1)],
        "generation": [dict(model="m1b", name="generate", kind="generate", batch=8, prompt=128 if not dry_run else 16)],
        "checkpoints": [dict(model="m1b", name="checkpoints", kind="checkpoints", bf16=True, batch=1, seq=256)],
        "planner": [dict(name="planner", kind="planner")],
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
            part_runs = [dict(r, part=part) for r in runs[part]]
            if part == "planner":
                part_runs[0]["measured"] = measured_for_planner(results)
            todo = functools.partial(run_workers, args, env, part, part_runs, max(left, 30))
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
    the image's Python 3.12."""
    from importlib.metadata import version

    lines = []
    for name in ("core.txt", "qlora.txt"):
        with open(os.path.join(ROOT, "hf_fsdp2", "requirements", name)) as f:
            lines += [line.split("#", 1)[0] for line in f]
    names = [line.split(">")[0].split("=")[0].split("<")[0].strip() for line in lines if line.strip()]
    # datasets' pins the image may not meet; huggingface_hub and tokenizers are left as the image has them.
    names += ["dill", "multiprocess", "fsspec", "regex"]
    pins = [f"{name}=={version(name)}" for name in names if name != "torch"]
    platforms = [f"--platform=manylinux_{v}_x86_64" for v in ("2_28", "2_24", "2_17")] + [
        "--platform=manylinux2014_x86_64"
    ]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version=3.12"]
    subprocess.run([*command, "--implementation=cp", *platforms, "-d", folder, *pins], check=True)


def build_runs(args: argparse.Namespace) -> list[dict]:
    """The one run of the build part: save both models."""
    return [{"name": "build", "kind": "build", "part": "build"}]


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
    """One worker process: plain Trainer as a plain process, the FSDP2 systems as rank 0 of a world of one.

    On the CPU rehearsal it is forked from a process that imported torch, transformers and the systems once
    (scripts/benchmark/forked_ranks.py: 13 fresh workers spent about half of the dry run importing); on a GPU it starts
    fresh, as a process that touched the GPU cannot be forked.
    """
    import forked_ranks

    env = dict(env)
    if system != "trainer":
        env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, os.path.abspath(__file__), "--worker", jobs]
    if env["GPU_CHECK_DRY_RUN"] == "1":
        process = forked_ranks.start(command, env, log)
    else:
        with open(log, "w") as output:
            process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.perf_counter() + timeout
    while process.poll() is None and time.perf_counter() < deadline:
        time.sleep(0.1)
    if process.poll() is None:
        process.kill()
        with open(log, "a") as output:
            output.write(f"\n[gpu_check] worker killed at its time limit ({timeout:.0f} s)\n")


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


def measured_for_planner(results: dict) -> list[dict]:
    """Every FSDP2Trainer training run measured so far, with what the planner needs to plan it again."""
    keys = ("model", "bf16", "batch", "seq", "ac", "offload", "chunk", "adapter", "compile")
    out = []
    for part, outcome in results["parts"].items():
        for name, run in outcome.get("runs", {}).items():
            spec = run.get("spec", {})
            if spec.get("system", "hf_fsdp2") == "hf_fsdp2" and "train_peak_mib" in run and part != "parity":
                out.append(
                    {
                        "run": f"{part}: {name}",
                        "train_peak_mib": run["train_peak_mib"],
                        **{k: spec.get(k) for k in keys},
                    }
                )
    return out


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
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[gpu_check] {spec['part']}: {spec['name']} done in {record['seconds']} s", flush=True)


def free_memory() -> None:
    """Drop what the last run left, so the next run's peak is its own."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_path(name: str) -> str:
    return os.path.join(os.environ["GPU_CHECK_WORKDIR"], f"model-{name}")


def dry_run() -> bool:
    return os.environ.get("GPU_CHECK_DRY_RUN") == "1"


def build(spec: dict) -> dict:
    """Save both models once (random weights, seeded), and describe the machine."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    described = {}
    for name, shape in sizes(dry_run()).items():
        if name == "run":
            continue
        config = LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv"], tie_word_embeddings=shape["tied"], rope_theta=500000.0,
            max_position_embeddings=131072,
        )  # fmt: skip
        saved = os.path.exists(os.path.join(model_path(name), "config.json"))
        torch.manual_seed(0)
        with torch.device("meta" if saved else device):  # a model saved by an earlier call is only counted
            model = LlamaForCausalLM(config).to(getattr(torch, shape["dtype"]))
        if not saved:
            model.save_pretrained(model_path(name))
        described[name] = {**shape, "params": sum(p.numel() for p in model.parameters())}
        del model
    gpu = torch.cuda.get_device_properties(0) if device == "cuda" else None
    environment = {
        "device_name": gpu.name if gpu else "cpu (dry run)" if dry_run() else "cpu",
        "device_memory_mib": round(gpu.total_memory / 2**20) if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "attention": "sdpa",
        "models": described,
        "date": time.strftime("%Y-%m-%d"),
    }
    return {"environment": environment}


def dataset(spec: dict, vocab: int) -> Any:
    """Token rows for a run: random, or (parity) 8 random rows repeated, which a model learns within 20 steps."""
    import torch
    from datasets import Dataset

    rows = spec["steps"] * spec["batch"]
    generator = torch.Generator().manual_seed(0)
    distinct = 8 if spec.get("data") == "pattern" else rows
    ids = torch.randint(0, vocab, (distinct, spec["seq"]), generator=generator).tolist()
    ids = [ids[i % distinct] for i in range(rows)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_arguments(spec: dict, out: str, **extra: Any) -> Any:
    """One schedule for every system: constant LR, a loss every step, no saves unless asked."""
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=spec["batch"], max_steps=spec["steps"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, bf16=spec.get("bf16", False), use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True, seed=0, **extra,
    )  # fmt: skip


def hf_fsdp2_trainer(spec: dict, data: Any, out: str, callbacks: list, **config: Any) -> Any:
    """FSDP2Trainer as a user writes it: the model path, or (adapters) a PeftModel over from_pretrained."""
    import torch
    from benchmark_systems import LORA
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    import hf_fsdp2

    config |= dict(consolidate_on_train_end=False, fsdp_activation_checkpointing=spec.get("ac", False))
    config |= dict(compile=spec.get("compile", False), cpu_offload=spec.get("offload", False))
    config |= dict(loss_chunk_size=spec.get("chunk"))
    fsdp2_config = hf_fsdp2.FSDP2Config(**config)
    args = training_arguments(spec, out)
    model: Any = model_path(spec["model"])
    if spec.get("adapter"):
        nf4 = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if spec.get("bf16") else torch.float32,
        )  # fmt: skip
        base = hf_fsdp2.from_pretrained(model, quantization_config=nf4 if spec["adapter"] == "qlora" else None)
        model = get_peft_model(base, LoraConfig(**LORA))
    return hf_fsdp2.FSDP2Trainer(model, args, fsdp2_config=fsdp2_config, train_dataset=data, callbacks=callbacks)


def plain_trainer(spec: dict, data: Any, out: str, callbacks: list) -> Any:
    """Plain Trainer on one device: fp32 weights, bf16 autocast when asked (what `bf16=True` gives)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(model_path(spec["model"]), dtype=torch.float32)
    args = training_arguments(spec, out, gradient_checkpointing=spec.get("ac", False))
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def accelerate_trainer(spec: dict, data: Any, out: str, callbacks: list) -> Any:
    """Trainer + Accelerate's FSDP2 plugin (the benchmark's configuration), activation checkpointing as asked."""
    import torch
    from benchmark_systems import AccelerateFSDP2Trainer
    from transformers import AutoModelForCausalLM

    fsdp_config = {
        "version": 2, "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": True,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
        "activation_checkpointing": spec.get("ac", False),
    }  # fmt: skip
    args = training_arguments(spec, out, fsdp=True, fsdp_config=fsdp_config)
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    model = AutoModelForCausalLM.from_pretrained(model_path(spec["model"]), dtype=torch.float32)
    return AccelerateFSDP2Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def memory_mark() -> float:
    """MiB at the high-water mark since the last reset: allocated GPU memory, or the resident set on the CPU."""
    from peak_memory import peak_bytes

    return peak_bytes() / 2**20


def reset_memory_mark() -> float:
    """Reset the high-water mark; the MiB a peak is counted above (0 on a GPU: its peaks are absolute, as the
    planner's are; the resident set now on the CPU, where the process's own libraries are not the run's)."""
    import torch
    from peak_memory import reset_peak

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        reset_peak()
        return 0.0
    return reset_peak() / 2**20


def probe(record: dict, start: float, baseline: float) -> Any:
    """A callback marking the end of loading, each step's time and loss."""
    import torch
    from transformers import TrainerCallback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            sync()
            record["load_s"] = round(time.perf_counter() - start, 3)
            record["load_peak_mib"] = round(memory_mark() - baseline, 1)
            if torch.cuda.is_available():  # on the CPU the mark goes on from the load: VmHWM cannot drop below RSS
                reset_memory_mark()

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            sync()
            self.step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            sync()
            record["step_s"].append(round(time.perf_counter() - self.step_start, 4))

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                record["losses"].append(float(logs["loss"]))

    return Probe()


BUILDERS = {"hf_fsdp2": hf_fsdp2_trainer, "trainer": plain_trainer, "accelerate": accelerate_trainer}


def train(spec: dict) -> dict:
    """Load and train one configuration; load time and peak, step times, losses, training peak, tokens/s."""
    import statistics

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path(spec["model"])).vocab_size
    data = dataset(spec, vocab)
    record: dict[str, Any] = {"step_s": [], "losses": []}
    out = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "runs", spec["part"], spec["name"].replace(" ", "_"))
    baseline = reset_memory_mark()
    trainer = BUILDERS[spec.get("system", "hf_fsdp2")](spec, data, out, [probe(record, time.perf_counter(), baseline)])
    trainer.train()
    record["train_peak_mib"] = round(memory_mark() - baseline, 1)
    timed = record["step_s"][spec["warmup"] :] or record["step_s"]
    record["step_median_s"] = round(statistics.median(timed), 4)
    record["tokens_per_s"] = round(spec["batch"] * spec["seq"] / record["step_median_s"], 1)
    del trainer
    return record


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def generate(spec: dict) -> dict:
    """Greedy generate tokens/s: the model sharded by FSDP2 and gathered for generate, against the plain model."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_fsdp2
    from hf_fsdp2.distributed import get_device

    path, new = model_path(spec["model"]), 128 if not dry_run() else 8
    device = get_device()
    ids = torch.randint(0, 1000, (spec["batch"], spec["prompt"]), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    dtype = torch.bfloat16
    models = {
        "unsharded": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(),
        "gathered": lambda: hf_fsdp2.prepare_model(
            hf_fsdp2.from_pretrained(path, dtype=dtype), hf_fsdp2.FSDP2Config(gather_for_generate=True)
        ).eval(),
    }
    record: dict[str, Any] = {"new_tokens": new}
    outputs = {}
    for name, make in models.items():
        model = make()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up: kernels, caches
            reset_memory_mark()
            start = time.perf_counter()
            outputs[name] = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            if _cuda():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        record[name] = {"seconds": round(seconds, 3), "tokens_per_s": round(spec["batch"] * new / seconds, 1)}
        del model
        free_memory()
    record["same_tokens"] = bool(torch.equal(outputs["unsharded"], outputs["gathered"]))
    return record


def checkpoints(spec: dict) -> dict:
    """Blocked time of sync and async saves, resume time, and consolidation, on the workdir's disk.

    Each mode writes to its own folder, keeping only its last checkpoint (1B: 15 GiB each, on a 64 GiB disk); a
    failure of one mode is recorded and the others still run.
    """
    from benchmark_worker import folder_bytes
    from transformers import AutoConfig

    steps = 2
    spec = dict(spec, steps=steps, lr=1e-5)
    data = dataset(dict(spec, steps=steps + 1), AutoConfig.from_pretrained(model_path(spec["model"])).vocab_size)
    root = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "checkpoints")
    shutil.rmtree(root, ignore_errors=True)
    record: dict[str, Any] = {"disk": disk_of(os.environ["GPU_CHECK_WORKDIR"])}
    for mode in ("sync", "async"):
        try:
            record |= save_twice(spec, data, os.path.join(root, mode), mode)
        except Exception as error:  # noqa: BLE001 - recorded; the other measurements still run
            traceback.print_exc()
            record[f"{mode}_error"] = f"{type(error).__name__}: {error}"[-1000:]
        free_memory()
        if mode == "async":
            shutil.rmtree(os.path.join(root, mode), ignore_errors=True)
    checkpoint = os.path.join(root, "sync", f"checkpoint-{steps}")
    record["checkpoint_bytes"] = folder_bytes(checkpoint)
    record |= resume_and_consolidate(spec, data, checkpoint, steps)
    shutil.rmtree(root, ignore_errors=True)
    return record


def save_twice(spec: dict, data: Any, folder: str, mode: str) -> dict:
    """Train 2 steps saving after each (the first async save also sets up its host buffers); the blocked times."""
    from benchmark_worker import _timed

    saves: list[float] = []
    trainer = hf_fsdp2_trainer(spec, data, folder, [], async_save=mode == "async")
    trainer.args.save_strategy, trainer.args.save_steps, trainer.args.save_total_limit = "steps", 1, 1
    trainer._save_checkpoint = _timed(saves, trainer._save_checkpoint)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    del trainer
    return {f"{mode}_save_blocked_s": [round(s, 3) for s in saves], f"{mode}_train_with_saves_s": round(seconds, 2)}


def resume_and_consolidate(spec: dict, data: Any, checkpoint: str, steps: int) -> dict:
    """Seconds to load a checkpoint into a fresh trainer, and to consolidate it into a Hugging Face folder."""
    from benchmark_worker import _timed, folder_bytes

    import hf_fsdp2

    resume: list[float] = []
    trainer = hf_fsdp2_trainer(dict(spec, steps=steps + 1), data, os.path.dirname(checkpoint), [])
    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state"):
        setattr(trainer, name, _timed(resume, getattr(trainer, name)))
    trainer.train(resume_from_checkpoint=checkpoint)
    del trainer
    free_memory()
    output = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "consolidated")
    shutil.rmtree(output, ignore_errors=True)
    start = time.perf_counter()
    hf_fsdp2.consolidate(checkpoint, output)
    seconds = time.perf_counter() - start
    written = folder_bytes(output)
    shutil.rmtree(output, ignore_errors=True)
    return {"resume_s": round(sum(resume), 3), "consolidate_s": round(seconds, 2), "consolidated_bytes": written}


def disk_of(path: str) -> str:
    """Which filesystem the checkpoints went to (tmpfs would make the save times RAM times)."""
    best = ("", "?")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            if os.path.abspath(path).startswith(point) and len(point) > len(best[0]):
                best = (point, kind)
    return f"{best[0]} ({best[1]})"


def planner(spec: dict) -> dict:
    """`hf-fsdp2 plan` (for a GPU; on the CPU rehearsal, for the CPU) against every measured FSDP2Trainer peak."""
    import torch
    from benchmark_systems import LORA

    import hf_fsdp2

    memory = torch.cuda.get_device_properties(0).total_memory if _cuda() else None
    rows = []
    for run in spec["measured"]:
        if run["offload"] and not _cuda():
            continue  # the trainer refuses cpu_offload without an accelerator, and so does the planner
        adapter = run["adapter"]
        planned = hf_fsdp2.plan(
            model_path(run["model"]), nproc=1, bf16=bool(run["bf16"]), batch=run["batch"], seq=run["seq"],
            activation_checkpointing=bool(run["ac"]), cpu_offload=bool(run["offload"]),
            lora_r=16 if adapter else None, qlora=adapter == "qlora", loss_chunk_size=run["chunk"],
            cpu=not _cuda(), device_memory=memory,
            **({"lora_targets": tuple(LORA["target_modules"])} if adapter else {}),
        )  # fmt: skip
        planned_mib = planned.training_peak / 2**20
        error = planned_mib / run["train_peak_mib"] - 1 if run["train_peak_mib"] > 0 else None
        rows.append({"run": run["run"], "planned_mib": round(planned_mib, 1), "measured_mib": run["train_peak_mib"]})
        rows[-1]["error"] = round(error, 3) if error is not None else None
    return {"rows": rows}


RUNNERS = {"train": train, "generate": generate, "checkpoints": checkpoints, "planner": planner, "build": build}


# ----------------------------------------------------------------------------------------------- the report


def render_markdown(results: dict) -> str:
    """The GPU tables of the README, from a results file."""
    env = results.get("environment", {})
    parts = results["parts"]
    calls = [*results.get("earlier_calls_wall_s", []), results.get("wall_s", 0)]
    took = " + ".join(f"{(seconds or 0) / 60:.1f}" for seconds in calls)
    lines = [
        f"Measured on {env.get('device_name', '?')} ({env.get('date', '?')}; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}) with `python scripts/measure/gpu_check.py`: {took} min"
        + (f" in {len(calls)} calls (the later ones with `--keep`)." if len(calls) > 1 else "."),
        "",
        "| part | status | seconds | call |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| {name} | {p['status']} | {p.get('seconds', '')} | {p.get('call', len(calls))} |"
        for name, p in parts.items()
    ]
    lines += _parity_table(parts.get("parity", {}))
    lines += _throughput_table(parts, env)
    lines += _simple_table(parts, "qlora", ["load_peak_mib", "train_peak_mib", "step_median_s", "tokens_per_s"])
    lines += _simple_table(parts, "long_rows", ["train_peak_mib", "step_median_s", "tokens_per_s"])
    lines += _simple_table(parts, "offload", ["train_peak_mib", "step_median_s", "tokens_per_s"])
    lines += _generation_table(parts.get("generation", {}))
    lines += _checkpoint_table(parts.get("checkpoints", {}))
    lines += _planner_table(parts.get("planner", {}))
    return "\n".join(lines)


def _ok(run: dict) -> bool:
    return "error" not in run


def _parity_table(part: dict) -> list[str]:
    """FSDP2Trainer's loss curve against plain Trainer's, per precision."""
    runs = part.get("runs", {})
    lines = [
        "",
        "| parity (100M, 20 steps) | max abs loss difference | tolerance | first → last loss |",
        "|---|---:|---:|---|",
    ]
    for precision in ("bf16", "fp32"):
        ours, theirs = runs.get(f"hf_fsdp2 {precision}", {}), runs.get(f"trainer {precision}", {})
        if not (_ok(ours) and _ok(theirs) and ours.get("losses") and theirs.get("losses")):
            lines.append(f"| {precision} | not measured | | |")
            continue
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        tolerance = BF16_REL_TOLERANCE * max(theirs["losses"]) if precision == "bf16" else FP32_TOLERANCE
        verdict = "within" if diff <= tolerance else "**outside**"
        curve = f"{ours['losses'][0]:.3f} → {ours['losses'][-1]:.3f}"
        lines.append(f"| {precision} | {diff:.2e} ({verdict}) | {tolerance:.1e} | {curve} |")
    return lines


def mfu(run: dict, env: dict) -> float | None:
    """Model FLOPs utilisation of a training run against the GPU's dense bf16 peak."""
    peak = next((v for k, v in PEAK_BF16.items() if k in env.get("device_name", "")), None)
    model = env.get("models", {}).get(run.get("spec", {}).get("model", ""))
    if peak is None or model is None or "tokens_per_s" not in run:
        return None
    computing = model["params"] - (0 if model["tied"] else model["vocab"] * model["hidden"])
    per_token = 6 * computing + 12 * model["layers"] * model["hidden"] * run["spec"]["seq"]
    return run["tokens_per_s"] * per_token / peak


def _throughput_table(parts: dict, env: dict) -> list[str]:
    """Tokens/s, MFU and peak memory of every 1B full fine-tuning run."""
    lines = ["", "| 1B, 4 x 2048 tokens, bf16 | tokens/s | MFU | peak allocated |", "|---|---:|---:|---:|"]
    for part in ("throughput", "compile", "offload"):
        for name, run in parts.get(part, {}).get("runs", {}).items():
            if not _ok(run):
                lines.append(f"| {name} | failed: {run['error'][:80]} | | |")
                continue
            share = mfu(run, env)
            mfu_text = f"{share:.1%}" if share is not None else "n/a"
            lines.append(f"| {name} | {run['tokens_per_s']:,.0f} | {mfu_text} | {run['train_peak_mib']:,.0f} MiB |")
    return lines


def _simple_table(parts: dict, part: str, keys: list[str]) -> list[str]:
    """One row per run of `part`, the given figures as columns."""
    runs = parts.get(part, {}).get("runs", {})
    if not runs:
        return []
    lines = ["", f"| {part} | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, run in runs.items():
        cells = [f"{run[k]:,}" if k in run else "failed" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _generation_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("generate", {})
    if not run or not _ok(run):
        return []
    return [
        "",
        f"| generate ({run['new_tokens']} new tokens) | tokens/s | same tokens |",
        "|---|---:|---|",
        f"| unsharded | {run['unsharded']['tokens_per_s']:,} | |",
        f"| FSDP2, gathered | {run['gathered']['tokens_per_s']:,} | {run['same_tokens']} |",
    ]


def _checkpoint_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("checkpoints", {})
    if not run:
        return []
    if "checkpoint_bytes" not in run:  # the whole run failed (a first version kept one record for every mode)
        return ["", "| checkpoints | seconds |", "|---|---:|", f"| failed | {run.get('error', '?')[:100]} |"]

    def saves(mode: str) -> str:
        if f"{mode}_error" in run:
            return "failed: " + run[f"{mode}_error"][:100]
        return ", ".join(map(str, run[f"{mode}_save_blocked_s"]))

    return [
        "",
        f"| checkpoints ({run['checkpoint_bytes'] / 2**30:.1f} GiB, on {run['disk']}) | seconds |",
        "|---|---:|",
        f"| sync save, blocked (1st, 2nd) | {saves('sync')} |",
        f"| async save, blocked (1st, 2nd) | {saves('async')} |",
        f"| resume | {run['resume_s']} |",
        f"| consolidate | {run['consolidate_s']} |",
    ]


def _planner_table(part: dict) -> list[str]:
    rows = part.get("runs", {}).get("planner", {}).get("rows", [])
    if not rows:
        return []
    lines = ["", "| planned against measured | planned | measured | error |", "|---|---:|---:|---:|"]
    for row in rows:
        error = f"{row['error']:+.1%}" if row["error"] is not None else "n/a"
        lines.append(f"| {row['run']} | {row['planned_mib']:,} MiB | {row['measured_mib']:,} MiB | {error} |")
    return lines


if __name__ == "__main__":
    main()
