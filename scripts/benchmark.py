"""Side-by-side benchmark: the same model, data, global batch and steps through
  hf_fsdp2            FSDP2Trainer (sync checkpoints), and again with async_save=True;
  accelerate_fsdp2    transformers.Trainer + Accelerate's FSDP2 plugin (sharded state dicts, RAM-efficient
                      loading) — forced onto FSDP2 on machines without accelerators, where Accelerate
                      silently falls back to DDP;
  transformers_fsdp2  from_pretrained(..., distributed_config=DistributedConfig(...)) + transformers.Trainer;
  ddp                 plain transformers.Trainer (unsharded DDP), the reference for the loss;
and two adapter rows compared with each other (their own table):
  hf_fsdp2_lora       LoRA r=16 on every projection, FSDP2Trainer, the base in the checkpoint's dtype;
  hf_fsdp2_qlora      the same LoRA on a 4-bit NF4 base (BitsAndBytesConfig -> torchao NF4; the 'qlora' extra).

Each run is its own process group (its ranks started as torchrun starts them); runs are interleaved (the
order rotates every repeat) and repeated, and the table gives medians with (min–max) and ratios against
accelerate_fsdp2.

Usage:
    python scripts/benchmark.py --quick                     # ~100M Llama, 2 ranks, under 6 min on 2 CPU cores
    python scripts/benchmark.py --long-context [...]        # long rows, sequence_parallel_size 1 vs 2
                                                            # (scripts/benchmark_long_context.py --help)
    python scripts/benchmark.py --sweep [...]               # load/save/resume/consolidation at 100M, 400M, 1.2B
                                                            # (scripts/benchmark_sweep.py --help)
    python scripts/benchmark.py --nproc 8 --repeats 3 --json bench.json --png bench.png --markdown bench.md

Memory is VmHWM (peak resident set) above the VmHWM measured right after imports, per rank, so each phase's
peak is what that phase added; on CUDA also torch's peak allocated GPU memory, bf16 compute and MFU. Bytes
all-gathered per step are counted at torch.distributed's all-gather calls (FSDP2's parameter gathers).
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
from benchmark_report import emit_markdown, render_markdown, render_png, summarize  # noqa: E402
from benchmark_worker import START_DIR_ENV  # noqa: E402
from measure_load_memory import MIB, build_model  # noqa: E402

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
NOTES = {
    "hf_fsdp2": "FSDP2Trainer(model path, FSDP2Config(consolidate_on_train_end=False)): every rank reads its own "
    "slices of the safetensors; consolidated with hf_fsdp2.consolidate, and timed as the command "
    "`python -m hf_fsdp2.cli consolidate` from start to exit.",
    "hf_fsdp2_async": "same as hf_fsdp2 with FSDP2Config(async_save=True); resume and consolidation not repeated.",
    "accelerate_fsdp2": "Trainer(fsdp=True, fsdp_config={version 2, SHARDED_STATE_DICT, cpu_ram_efficient_loading, "
    "LlamaDecoderLayer}) with ACCELERATE_USE_FSDP=true (what `accelerate launch --use_fsdp` exports); "
    "consolidated with accelerate's merge_fsdp_weights, and timed as the command `accelerate merge-weights` "
    "(`python -m accelerate.commands.accelerate_cli`) from start to exit.",
    "transformers_fsdp2": "from_pretrained(distributed_config=DistributedConfig(fsdp_size=world)) + Trainer, which "
    "refuses optimizer checkpoints for such models: saves the gathered model only (save_only_model=True), "
    "so it has no resume and its checkpoints need no consolidation.",
    "ddp": "plain Trainer: every rank holds the whole model; rank 0 writes full checkpoints (nothing to consolidate).",
    "hf_fsdp2_lora": "get_peft_model(hf_fsdp2.from_pretrained(path), LoraConfig(r=16, every projection)) + "
    "FSDP2Trainer; adapter-only checkpoints (nothing to consolidate).",
    "hf_fsdp2_qlora": "the same with from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
    "bnb_4bit_quant_type='nf4')): the base's eligible linear weights are torchao NF4, sharded.",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver (the worker reuses the same options)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 repeats (the adapter rows 1) of 4 steps of 64-token sequences (under 6 min on 2 CPU cores)",
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--repeats", type=int, default=None, help="runs per system (default 3, --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 16, --quick 4)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="first steps left out of step time (default 2, --quick 1)"
    )
    parser.add_argument("--batch", type=int, default=1, help="per-device batch size")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128, --quick 64)")
    parser.add_argument("--layers", type=int, default=12, help="12 layers of hidden 768 = 97M parameters")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--no-resume", dest="resume", action="store_false", help="skip the resume measurement")
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_benchmark")
    parser.add_argument("--json", default=None, help="write every figure (per run, per rank) here")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--png", default=None, help="write a bar chart of the ratios here")
    parser.add_argument(
        "--from-json", default=None, help="re-render the tables and chart of a --json file, run nothing"
    )
    parser.add_argument("--optim", default=None, help=argparse.SUPPRESS)  # the sweep's largest size: sgd
    for hidden in ("--worker", "--system", "--model-path", "--run-dir", "--result", "--checkpoint", "--output"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.steps = args.steps or (4 if args.quick else 16)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    args.samples = args.samples or (args.steps + 1) * args.batch * args.nproc
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown system(s) {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


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
        os.path.abspath(__file__),
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
        os.path.abspath(__file__),
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


def _run_options(args: argparse.Namespace) -> dict:
    """The options that shaped the runs (enough to summarize them again)."""
    keys = ("nproc", "repeats", "steps", "warmup", "batch", "seq_len", "layers", "hidden", "vocab", "systems")
    return {key: getattr(args, key) for key in keys}


def main() -> None:
    if "--sweep" in sys.argv[1:]:
        # Load, save, resume and consolidation at three model sizes, against the physical limit: its own script.
        from benchmark_sweep import main as sweep

        return sweep([a for a in sys.argv[1:] if a != "--sweep"])
    if "--long-context" in sys.argv[1:]:
        # Long rows with and without sequence parallelism: its own script, options and tables.
        from benchmark_long_context import main as long_context

        return long_context([a for a in sys.argv[1:] if a != "--long-context"])
    args = parse_args()
    if args.worker:
        from benchmark_worker import consolidate_worker, train_worker

        return train_worker(args) if args.worker == "train" else consolidate_worker(args)

    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        return report(
            saved["runs"],
            argparse.Namespace(**saved["args"]),
            saved["summary"]["model_bytes"],
            saved["summary"]["wall_s"],
            argparse.Namespace(**{**vars(args), "json": None}),
        )
    os.makedirs(args.workdir, exist_ok=True)
    model_path = os.path.join(args.workdir, f"llama-{args.layers}l-{args.hidden}h-{args.vocab}v-tied")
    model_bytes = build_model(model_path, args.layers, hidden=args.hidden, vocab=args.vocab, tied=True)
    read_through(model_path)
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    started = time.perf_counter()
    warm_up(args, systems[0], model_path)
    for repeat in range(args.repeats):
        order = systems[repeat % len(systems) :] + systems[: repeat % len(systems)]
        if args.quick and repeat > 0:  # --quick: the adapter rows once (their own table, no targets of issue 24)
            order = [system for system in order if system not in ADAPTER_SYSTEMS]
        for system in order:
            tag = f"r{repeat}"
            print(f"[{time.perf_counter() - started:6.0f} s] repeat {repeat + 1}/{args.repeats}: {system}", flush=True)
            run = run_training(args, system, model_path, tag)
            if system in CONSOLIDATES:
                run["consolidate"] = run_consolidation(args, system, run["checkpoint"], tag)
            runs[system].append(run)
    report(runs, args, model_bytes, time.perf_counter() - started, args)


def report(
    runs: dict[str, list[dict]], args: argparse.Namespace, model_bytes: int, wall_s: float, outputs: argparse.Namespace
) -> None:
    """Summarize the runs, print the tables and write the files `outputs` asks for."""
    summary = summarize(runs, args, model_bytes)
    summary["wall_s"] = wall_s
    for system in runs:
        first = runs[system][0]["ranks"][0]
        sharded = "parameters sharded (DTensor)" if first["sharded_fraction"] == 1 else "parameters not sharded"
        summary["systems"][system]["notes"] = " ".join([NOTES[system], *first["notes"], f"[{sharded}]"])
    emit_markdown(render_markdown(summary), outputs.markdown)
    if outputs.json:
        with open(outputs.json, "w") as f:
            json.dump({"args": _run_options(args), "summary": summary, "runs": runs}, f, indent=2)
    if outputs.png:
        render_png(summary, outputs.png)
    print(f"model: {model_bytes / MIB:.0f} MiB; total {summary['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
