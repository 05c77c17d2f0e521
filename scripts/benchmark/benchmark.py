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
    python scripts/benchmark/benchmark.py --quick               # ~100M Llama, 2 ranks, under 6 min on 2 CPU cores
    python scripts/benchmark/benchmark.py --long-context [...]  # long rows, sequence_parallel_size 1 vs 2
                                                    # (scripts/benchmark/benchmark_long_context.py --help)
    python scripts/benchmark/benchmark.py --sweep [...]         # load/save/resume/consolidation at 100M, 400M, 1.2B
                                                    # (scripts/benchmark/benchmark_sweep.py --help)
    python scripts/benchmark/benchmark.py --nproc 8 --repeats 3 --json bench.json --png bench.png --markdown bench.md

Memory is VmHWM (peak resident set) above the VmHWM measured right after imports, per rank, so each phase's
peak is what that phase added; on CUDA also torch's peak allocated GPU memory, bf16 compute and MFU. Bytes
all-gathered per step are counted at torch.distributed's all-gather calls (FSDP2's parameter gathers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "benchmark"), os.path.join(SCRIPTS, "common")]
from benchmark_report import emit_markdown, render_markdown, render_png, summarize  # noqa: E402
from benchmark_runs import (  # noqa: E402
    ADAPTER_SYSTEMS,
    CONSOLIDATES,
    SYSTEMS,
    read_through,
    run_consolidation,
    run_training,
    warm_up,
)
from llama_model import build_model  # noqa: E402
from peak_memory import MIB  # noqa: E402

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
