"""Long rows with and without sequence parallelism on the same ranks: per-rank training peak and tokens/s
against row length, the longest row within a memory budget, and the planner's figure beside each measurement.

Every point is one torchrun launch of FSDP2Trainer on a Llama (GQA), one row per rank per step (one document
per row by default, so both settings run the same causal attention kernel; --doc packs documents), at N=1 (no
switch) and N=sequence_parallel_size. The peak is the rise of the process's resident high-water mark during
train() (CPU: VmHWM reset before training; GPU: max_memory_allocated), worst rank; it includes the optimizer
state made at the first step. tokens/s counts every rank's tokens over the steps after the first. Both settings
use the same loss_chunk_size.

Usage:
    python scripts/benchmark/benchmark.py --long-context                        # 2 CPU ranks, rows of 8k..32k tokens
    python scripts/benchmark/benchmark_long_context.py --seqs 4096,8192 --budget-mib 600 --json lc.json --png lc.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from peak_memory import peak_bytes, reset_peak  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sp", type=int, default=2, help="sequence_parallel_size compared with 1")
    parser.add_argument("--seqs", default="8192,16384,32768", help="row lengths of the curve")
    parser.add_argument("--budget-mib", type=float, default=None, help="default: 1.1 x N=1 peak at the second-longest")
    parser.add_argument("--max-seq", type=int, default=32768, help="longest row tried when searching the budget")
    parser.add_argument("--doc", type=int, default=0, help="tokens per packed document (0: one per row)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--loss-chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="steps per point; the first is not timed")
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_long_context")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--from-json", default=None, help="print the README block of a --json file, run nothing")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "SEQ,N"
    return parser.parse_args(argv)


def build(path: str, args: argparse.Namespace) -> None:
    """Save a randomly initialized Llama with GQA (untied head)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_seq, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    """One rank of one point: train a few steps on packed rows, report peak, step times and losses."""
    import torch
    from transformers import TrainerCallback, TrainingArguments

    import hf_fsdp2

    seq, size = (int(x) for x in args.worker.split(","))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(0)
    positions = [i % (args.doc or seq) for i in range(seq)]
    data = []
    for _ in range(world * args.steps):
        ids = torch.randint(3, args.vocab, (seq,), generator=g).tolist()
        data.append({"input_ids": ids, "labels": ids, "position_ids": positions})
    training = TrainingArguments(
        os.path.join(args.workdir, f"run-{seq}-{size}"), per_device_train_batch_size=1, max_steps=args.steps,
        use_cpu=not torch.cuda.is_available(), save_strategy="no", report_to=[], disable_tqdm=True,
        logging_steps=1, learning_rate=1e-4,
    )  # fmt: skip
    config = hf_fsdp2.FSDP2Config(
        consolidate_on_train_end=False, loss_chunk_size=args.loss_chunk, sequence_parallel_size=size,
        checkpoint_on_signals=[],
    )  # fmt: skip
    path = os.path.join(args.workdir, "model")
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter())

    trainer = hf_fsdp2.FSDP2Trainer(path, training, train_dataset=data, fsdp2_config=config, callbacks=[Clock()])
    before = reset_peak()
    trainer.train()
    peak = peak_bytes() - before
    steps = [end - start for start, end in zip(times[::2], times[1::2], strict=True)]
    row = {"peak_mib": peak / 2**20, "before_mib": before / 2**20, "steps_s": steps}
    rows: list = [None] * world
    torch.distributed.all_gather_object(rows, row)
    if rank == 0:
        timed = [max(r["steps_s"][i] for r in rows) for i in range(1, len(steps))]  # the slowest rank sets the pace
        result = {
            "seq": seq,
            "sp": size,
            "peak_mib": max(r["peak_mib"] for r in rows),
            "before_mib": max(r["before_mib"] for r in rows),
            "tokens_per_s": world * seq * len(timed) / sum(timed),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        }
        with open(os.path.join(args.workdir, f"result-{seq}-{size}.json"), "w") as f:
            json.dump(result, f)


def measure(args: argparse.Namespace, seq: int, size: int) -> dict:
    """One point, launched on its own (a fresh process per point: peaks never mix)."""
    out = os.path.join(args.workdir, f"result-{seq}-{size}.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
        "--worker", f"{seq},{size}", *_model_flags(args),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    result["planned_mib"] = planned_mib(args, seq, size)
    print(
        f"  seq {seq:>6} N={size}: peak {result['peak_mib']:8.1f} MiB (planned {result['planned_mib']:8.1f}), "
        f"{result['tokens_per_s']:8.0f} tokens/s",
        flush=True,
    )
    return result


def planned_mib(args: argparse.Namespace, seq: int, size: int) -> float:
    """The planner's training peak minus what is resident before training (sharded parameters, buffers, runtime)."""
    from hf_fsdp2.planning.memory_plan import plan

    result = plan(
        os.path.join(args.workdir, "model"), nproc=args.nproc, seq=seq, loss_chunk_size=args.loss_chunk,
        sequence_parallel=size, optim="adamw_torch",
    )  # fmt: skip
    training = next(p for p in result.phases if p.name == "training").parts
    loaded = ("sharded parameters", "buffers", "process runtime (CPU)")
    return sum(v for k, v in training.items() if k not in loaded) / 2**20


def _model_flags(args: argparse.Namespace) -> list[str]:
    names = ("doc", "hidden", "layers", "heads", "kv_heads", "vocab", "loss_chunk", "steps", "workdir", "max_seq")
    return [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def longest_within(args: argparse.Namespace, size: int, budget: float, points: dict) -> int:
    """The longest row (doubling from the curve's longest) whose peak stays within `budget` at N=`size`."""
    fitting = [seq for (seq, n), r in points.items() if n == size and r["peak_mib"] <= budget]
    if not fitting:
        return 0
    seq = max(fitting)
    while 2 * seq <= args.max_seq and (seq == max(s for s, n in points if n == size)):
        nxt = 2 * seq
        points[(nxt, size)] = measure(args, nxt, size)
        if points[(nxt, size)]["peak_mib"] > budget:
            break
        seq = nxt
    return seq


def table(points: dict, sizes: tuple[int, int]) -> list[str]:
    """Markdown rows: per length, each setting's peak and tokens/s, and their ratios."""
    one, many = sizes
    lines = [
        f"| row (tokens) | peak N=1 (MiB) | peak N={many} (MiB) | ratio | planned N={many} | tokens/s N=1 | "
        f"tokens/s N={many} | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seq in sorted({s for s, _ in points}):
        a, b = points.get((seq, one)), points.get((seq, many))
        if a is None or b is None:
            continue
        lines.append(
            f"| {seq} | {a['peak_mib']:.0f} | {b['peak_mib']:.0f} | {b['peak_mib'] / a['peak_mib']:.2f} | "
            f"{b['planned_mib']:.0f} ({b['planned_mib'] / b['peak_mib']:.2f}) | {a['tokens_per_s']:.0f} | "
            f"{b['tokens_per_s']:.0f} | {b['tokens_per_s'] / a['tokens_per_s']:.2f} |"
        )
    return lines


def render_markdown(saved: dict) -> str:
    """The README block of a saved run: its setting, the table and the budget line."""
    a = saved["args"]
    head = (
        f"Llama {a['layers']} x {a['hidden']} ({a['heads']} heads, {a['kv_heads']} kv), vocab {a['vocab']}, "
        f"{a['nproc']} ranks, one row per rank per step, loss_chunk_size {a['loss_chunk']} in both settings; peak: "
        "training peak per rank above what was resident before training (worst rank)."
    )
    return "\n".join([head, "", *saved["table"]])


def plot(points: dict, sizes: tuple[int, int], budget: float, path: str) -> None:
    """Peak and tokens/s against row length, one line per setting, the budget as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(10, 4))
    for size in sizes:
        seqs = sorted(s for s, n in points if n == size)
        label = "no sequence parallelism" if size == 1 else f"sequence_parallel_size={size}"
        mem.plot(seqs, [points[(s, size)]["peak_mib"] for s in seqs], marker="o", label=label)
        speed.plot(seqs, [points[(s, size)]["tokens_per_s"] for s in seqs], marker="o", label=label)
    mem.axhline(budget, linestyle="--", color="gray", label=f"budget {budget:.0f} MiB")
    for axis, title in ((mem, "training peak per rank (MiB)"), (speed, "tokens/s (all ranks)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("row length (tokens)")
        axis.set_title(title)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    if args.from_json:
        with open(args.from_json) as f:
            print(render_markdown(json.load(f)))
        return None
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.isfile(os.path.join(args.workdir, "model", "config.json")):
        build(os.path.join(args.workdir, "model"), args)
    sizes = (1, args.sp)
    seqs = [int(s) for s in args.seqs.split(",")]
    print(f"Llama {args.layers} x {args.hidden} ({args.heads} heads, {args.kv_heads} kv), {args.nproc} ranks:")
    points = {(seq, size): measure(args, seq, size) for seq in seqs for size in sizes}
    budget = args.budget_mib or 1.10 * points[(seqs[-2] if len(seqs) > 1 else seqs[-1], 1)]["peak_mib"]
    longest = {size: longest_within(args, size, budget, points) for size in sizes}
    lines = table(points, sizes)
    lines.append("")
    lines.append(
        f"Longest row within {budget:.0f} MiB per rank: {longest[1]} tokens at N=1, {longest[args.sp]} at "
        f"N={args.sp} ({longest[args.sp] / max(longest[1], 1):.1f}x)."
    )
    print("\n".join(lines))
    if args.png:
        plot(points, sizes, budget, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "points": [points[k] for k in sorted(points)],
                    "budget_mib": budget,
                    "longest_within_budget": {str(k): v for k, v in longest.items()},
                    "table": lines,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
