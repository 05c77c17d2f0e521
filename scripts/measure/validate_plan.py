"""Compare `hf-fsdp2 plan`'s per-rank load and training peaks with what real runs measure on this machine.

For every case of the matrix (model size × ranks × full/LoRA × activation checkpointing) it plans the run,
then launches it with torchrun (CPU, gloo): each rank records VmHWM (peak resident set) right after the
imports, after FSDP2Trainer is built (load) and after a few training steps (training), and reports the
peaks above the after-import baseline, as the other memory scripts do. The table shows predicted and
measured MiB of the worst rank and their ratio; the goal is every ratio within 0.85–1.15.

Usage:
    python scripts/measure/validate_plan.py                       # the default matrix (about 20 minutes on 2 cores)
    python scripts/measure/validate_plan.py --quick --json plan_validation.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from llama_model import build_model  # noqa: E402
from peak_memory import MIB, vm_kib  # noqa: E402

SIZES = {"small": (6, 512), "medium": (12, 768)}  # layers, hidden (vocab 16000): ~30M and ~100M parameters
# A Qwen3-MoE (8 experts, top-2, fused experts on torch's grouped_mm) of 6 layers of 512: ~60M parameters.
MOE = "moe"


def build_moe(path: str) -> None:
    """Save the MoE model of the `moe` size under `path` once."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    config = Qwen3MoeConfig(
        vocab_size=16000, hidden_size=512, intermediate_size=1376, moe_intermediate_size=512, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
        output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="small,medium", help=f"comma-separated subset of {[*SIZES, MOE]} (moe: a Qwen3-MoE)"
    )
    parser.add_argument("--nproc", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16 (fp32 masters)")
    parser.add_argument("--quick", action="store_true", help="medium model, 2 ranks only")
    parser.add_argument(
        "--default-allocator", action="store_true", help="measure with glibc's default malloc settings (see measure)"
    )
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_validate_plan")
    parser.add_argument("--json", default=None, help="write every case here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One rank of one case: load, train a few steps, report VmHWM above the after-import baseline."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_fsdp2 import FSDP2Config, FSDP2Trainer, from_pretrained

    baseline = vm_kib("VmHWM")
    model = from_pretrained(args.model_path, AutoModelForCausalLM)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ids = torch.randint(3, 16000, (args.batch * world * args.steps, args.seq)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    targs = TrainingArguments(
        output_dir=os.path.join(args.workdir, "run"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, bf16=args.bf16,
    )  # fmt: skip
    config = FSDP2Config(fsdp_activation_checkpointing=args.ac, consolidate_on_train_end=False)
    trainer = FSDP2Trainer(model, targs, fsdp2_config=config, train_dataset=data, callbacks=[_StepPeaks(baseline)])
    load = vm_kib("VmHWM")
    trainer.train()
    train = vm_kib("VmHWM")
    row = {"load_mib": (load - baseline) / 1024, "train_mib": (train - baseline) / 1024}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(rows, f)


class _StepPeaks:
    """Print each step's VmRSS and VmHWM above the baseline (with HF_FSDP2_PLAN_DEBUG=1)."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline

    def __getattr__(self, name: str):  # every other TrainerCallback event: nothing to do
        return lambda *args, **kwargs: None

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if os.environ.get("HF_FSDP2_PLAN_DEBUG") and os.environ.get("RANK") == "0":
            rss, hwm = (vm_kib(f) - self.baseline for f in ("VmRSS", "VmHWM"))
            print(f"step {state.global_step}: rss {rss / 1024:.0f} MiB, hwm {hwm / 1024:.0f} MiB", flush=True)


def measure(
    args: argparse.Namespace, model_path: str, nproc: int, lora: bool, ac: bool, bf16: bool = False
) -> list[dict]:
    """Launch one case; return each rank's measured peaks."""
    result = os.path.join(args.workdir, "result.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        os.path.abspath(__file__), "--worker", "--model-path", model_path, "--result", result,
        "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--workdir", args.workdir,
        *(["--lora"] if lora else []), *(["--ac"] if ac else []), *(["--bf16"] if bf16 else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.default_allocator:
        # glibc keeps freed blocks of up to 32 MiB in its heap once a large block was freed (its dynamic mmap
        # threshold), so without this RSS keeps freed activations: a fixed threshold returns every block of
        # 64 KiB or more to the system when freed, and VmHWM then follows live tensors, as
        # torch.cuda.max_memory_allocated does on a GPU.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"case failed: {' '.join(command)}\n{proc.stdout[-6000:]}")
    with open(result) as f:
        return json.load(f)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    from hf_fsdp2.planning.memory_plan import plan

    sizes = ["medium"] if args.quick else args.sizes.split(",")
    ranks = [2] if args.quick else [int(n) for n in args.nproc.split(",")]
    os.makedirs(args.workdir, exist_ok=True)
    cases = []
    started = time.perf_counter()
    for size in sizes:
        path = os.path.join(args.workdir, f"llama-{size}" if size != MOE else "qwen3-moe")
        if size == MOE:
            build_moe(path)
        else:
            build_model(path, *SIZES[size][:1], hidden=SIZES[size][1])
        for nproc, bf16, lora, ac in itertools.product(
            ranks, [p == "bf16" for p in args.precisions.split(",")], (False, True), (False, True)
        ):
            predicted = plan(
                path, nproc=nproc, bf16=bf16, lora_r=16 if lora else None, batch=args.batch, seq=args.seq,
                activation_checkpointing=ac, device_memory=2**40,
            )  # fmt: skip
            phases = {p.name: p.total / MIB for p in predicted.phases}
            rows = measure(args, path, nproc, lora, ac, bf16)
            # VmHWM is a high-water mark: the training figure is the peak of load and training together.
            case = {"size": size, "nproc": nproc, "bf16": bf16, "lora": lora, "ac": ac}
            case["load"] = {"predicted": phases["load"], "measured": max(r["load_mib"] for r in rows)}
            case["training"] = {"predicted": phases["training"], "measured": max(r["train_mib"] for r in rows)}
            cases.append(case)
            print(f"[{time.perf_counter() - started:5.0f} s] {_row(case)}", flush=True)
    print(render(cases, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cases": cases}, f, indent=2)


def _row(case: dict) -> str:
    precision = "bf16" if case.get("bf16") else "fp32"
    cells = [
        case["size"],
        str(case["nproc"]),
        precision,
        "LoRA" if case["lora"] else "full",
        "on" if case["ac"] else "off",
    ]
    for phase in ("load", "training"):
        p, m = case[phase]["predicted"], case[phase]["measured"]
        cells += [f"{p:.0f}", f"{m:.0f}", f"{p / m:.2f}" if m > 0 else "–"]
    return "| " + " | ".join(cells) + " |"


def render(cases: list[dict], args: argparse.Namespace) -> str:
    """The markdown table the README shows."""
    lines = [
        f"Per-rank peak above the after-import baseline (MiB, worst rank), batch {args.batch} × seq {args.seq}, "
        f"{args.steps} steps, AdamW (fused), CPU/gloo, "
        f"{'glibc default malloc' if args.default_allocator else 'MALLOC_MMAP_THRESHOLD_=65536'}. "
        "Ratio = predicted / measured (goal 0.85–1.15).",
        "",
        "| model | ranks | precision | tuning | act. ckpt | load predicted | load measured | ratio "
        "| training predicted | training measured | ratio |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(case) for case in cases]
    within = [abs(c[p]["predicted"] / c[p]["measured"] - 1) <= 0.15 for c in cases for p in ("load", "training")]
    lines += ["", f"{sum(within)} of {len(within)} figures within ±15%."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
