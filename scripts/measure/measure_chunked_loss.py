"""The loss's share of the training peak with and without `FSDP2Config(loss_chunk_size=...)`, on a Llama with a
large vocabulary and long rows, where the full logits (sequence x vocabulary, upcast to fp32) dominate.

Each setting trains a few steps with FSDP2Trainer; the peak is `torch.cuda.max_memory_allocated` on a GPU, VmHWM
above the after-import baseline on the CPU; the loss and the gradient norm of each step are printed so the runs
can be compared (the same numbers up to summation order).

Usage:
    python scripts/measure/measure_chunked_loss.py                            # 2 CPU ranks, seq 4096, vocab 32000
    python scripts/measure/measure_chunked_loss.py --seq 16384 --nproc 1 --chunk 2048 --json chunked.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from peak_memory import vm_kib  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per row (one row per rank)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024, help="loss_chunk_size of the chunked run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_chunked_loss")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(path: str, args: argparse.Namespace) -> None:
    """Save a randomly initialized Llama (untied head: the logits are the head's own)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    """One rank of one setting: train, report the training peak, losses and gradient norms."""
    import torch
    from transformers import TrainingArguments

    import hf_fsdp2

    baseline = vm_kib("VmHWM") * 1024
    chunk = int(args.worker) or None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ids = torch.randint(3, args.vocab, (world * args.steps, args.seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids.tolist()]
    training = TrainingArguments(
        os.path.join(args.workdir, f"run-{args.worker}"), per_device_train_batch_size=1, max_steps=args.steps,
        use_cpu=not torch.cuda.is_available(), save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    config = hf_fsdp2.FSDP2Config(consolidate_on_train_end=False, loss_chunk_size=chunk)
    path = os.path.join(args.workdir, "model")
    trainer = hf_fsdp2.FSDP2Trainer(path, training, train_dataset=data, fsdp2_config=config)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else vm_kib("VmHWM") * 1024 - baseline
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else vm_kib("VmHWM") * 1024 - baseline
    history = [h for h in trainer.state.log_history if "loss" in h]
    row = {"peak_mib": peak / 2**20, "before_training_mib": start / 2**20}
    rows = [None] * world
    torch.distributed.all_gather_object(rows, row)
    if torch.distributed.get_rank() == 0:
        result = {
            "peak_mib": max(r["peak_mib"] for r in rows),
            "before_training_mib": max(r["before_training_mib"] for r in rows),
            "losses": [h["loss"] for h in history],
            "grad_norms": [h["grad_norm"] for h in history],
        }
        with open(os.path.join(args.workdir, f"result-{args.worker}.json"), "w") as f:
            json.dump(result, f)


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        return worker(args)
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.isfile(os.path.join(args.workdir, "model", "config.json")):
        build(os.path.join(args.workdir, "model"), args)
    results = {}
    for chunk in (0, args.chunk):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
            "--worker", str(chunk), "--seq", str(args.seq), "--vocab", str(args.vocab), "--steps", str(args.steps),
            "--workdir", args.workdir,
        ]  # fmt: skip
        subprocess.run(
            command, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        )
        with open(os.path.join(args.workdir, f"result-{chunk}.json")) as f:
            results[chunk] = json.load(f)
    logits_mib = args.seq * args.vocab * 4 / 2**20
    shape = f"Llama {args.layers} x {args.hidden}, vocab {args.vocab}"
    print(f"\n{shape}, 1 row of {args.seq} tokens per rank, {args.nproc} ranks")
    print(f"full logits of one row in fp32: {logits_mib:.0f} MiB")
    print("| loss_chunk_size | training peak above the loaded model (MiB, worst rank) | losses |")
    print("|---|---:|---|")
    for chunk, r in results.items():
        above = r["peak_mib"] - r["before_training_mib"]
        print(f"| {chunk or 'off'} | {above:.0f} | {', '.join(f'{x:.6f}' for x in r['losses'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "logits_mib": logits_mib}, f, indent=1)


if __name__ == "__main__":
    main()
