"""QLoRA beside LoRA on the same Llama: per-rank load and training peak, step time and tokens/s.

Each mode trains the same LoRA adapter (every linear projection) with FSDP2Trainer: `lora` on the base in the
load dtype, `qlora` on a 4-bit NF4 base (BitsAndBytesConfig -> torchao NF4). Peaks are
`torch.cuda.max_memory_allocated` on a GPU, VmHWM above the after-import baseline on the CPU.

Usage:
    python scripts/measure/measure_qlora.py                                  # a small Llama on this CPU, 2 ranks
    python scripts/measure/measure_qlora.py --size 1b --nproc 1 --bf16 --seq 2048 --batch 4 --json qlora_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from peak_memory import vm_kib  # noqa: E402

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "small": (512, 1024, 4, 8, 4, 8000),
    "1b": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B's shape
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="rows per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bf16", action="store_true", help="bf16 checkpoint and compute (fp32 LoRA masters)")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing (FSDP2Config)")
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_qlora")
    parser.add_argument("--modes", default="lora,qlora", help="comma-separated: lora, qlora")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(path: str, size: str, bf16: bool) -> None:
    """Save a randomly initialized Llama of `size` (fast: built on the accelerator when there is one)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=4096,
    )  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if bf16 else torch.float32)
    model.save_pretrained(path)


def peak_bytes(baseline: int) -> int:
    """The peak so far: accelerator memory allocated, or the process's VmHWM above `baseline`."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return vm_kib("VmHWM") * 1024 - baseline


def worker(args: argparse.Namespace) -> None:
    """One rank of one mode: build the trainer (load), train, report peaks and step times."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, TrainerCallback, TrainingArguments

    import hf_fsdp2

    baseline = vm_kib("VmHWM") * 1024
    mode = args.worker
    path = os.path.join(args.workdir, f"llama-{args.size}")
    # The compute dtype is the dtype of the base's dense weights and of each dequantized NF4 weight: the
    # checkpoint's, as LoRA's frozen base (bitsandbytes' default is float32).
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    quantization = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        if mode == "qlora"
        else None
    )
    base = hf_fsdp2.from_pretrained(path, quantization_config=quantization)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vocab = SIZES[args.size][5]
    ids = torch.randint(3, vocab, (args.batch * world * (args.steps + 1), args.seq)).tolist()
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    training = TrainingArguments(
        os.path.join(args.workdir, mode), per_device_train_batch_size=args.batch, max_steps=args.steps,
        bf16=args.bf16, use_cpu=not torch.cuda.is_available(), save_strategy="no", report_to=[], disable_tqdm=True,
        logging_steps=args.steps,
    )  # fmt: skip
    config = hf_fsdp2.FSDP2Config(consolidate_on_train_end=False, fsdp_activation_checkpointing=args.ac)
    data = [{"input_ids": row, "labels": row} for row in ids]  # a plain list: no `datasets` needed
    trainer = hf_fsdp2.FSDP2Trainer(
        model=model, args=training, train_dataset=data, fsdp2_config=config, callbacks=[Clock()]
    )
    load = peak_bytes(baseline)
    trainer.train()
    train = peak_bytes(baseline)
    step = statistics.median(times[1:])
    row = {"load_mib": load / 2**20, "train_mib": train / 2**20, "step_s": step,
           "tokens_per_s": args.batch * args.seq / step}  # fmt: skip
    rows = [None] * world
    torch.distributed.all_gather_object(rows, row)
    if torch.distributed.get_rank() == 0:
        worst = {k: max(r[k] for r in rows) for k in ("load_mib", "train_mib", "step_s")}
        worst["tokens_per_s"] = min(r["tokens_per_s"] for r in rows)  # per rank
        with open(os.path.join(args.workdir, f"{mode}.json"), "w") as f:
            json.dump(worst, f)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"llama-{args.size}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build(path, args.size, args.bf16)
    results = {}
    for mode in args.modes.split(","):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
            "--worker", mode, "--size", args.size, "--batch", str(args.batch), "--seq", str(args.seq),
            "--steps", str(args.steps), "--workdir", args.workdir, *(["--bf16"] if args.bf16 else []),
            *(["--ac"] if args.ac else []),
        ]  # fmt: skip
        subprocess.run(
            command, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        )
        with open(os.path.join(args.workdir, f"{mode}.json")) as f:
            results[mode] = json.load(f)
    where = "GPU memory allocated" if _has_cuda() else "RSS above baseline"
    precision = "bf16" if args.bf16 else "fp32"
    print(f"\nLlama {args.size}, {args.nproc} rank(s), batch {args.batch} x seq {args.seq} per rank, {precision}, ")
    checkpointing = "activation checkpointing on" if args.ac else "activation checkpointing off"
    print(f"LoRA r=16 on every projection, {checkpointing}; peaks are {where}, worst rank")
    print("| mode | load peak (MiB) | training peak (MiB) | step (median, s) | tokens/s per rank |")
    print("|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['load_mib']:.0f} | {r['train_mib']:.0f} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
