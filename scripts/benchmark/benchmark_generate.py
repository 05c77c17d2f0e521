"""Greedy generate() on a model sharded by hf_fsdp2 against the same model unsharded in one process.

The sharded model runs on N ranks (torchrun), each rank generating for its own batch of prompts: once with every
unit gathered once per call (the default, FSDP2Config(gather_for_generate=True)) and once gathering per token
(gather_for_generate=False, what FSDP2 does by itself). The unsharded model, in one process, generates for
every rank's batch, one batch at a time; its time per batch is the reference. Tokens must be identical. Memory,
worst rank: the peak torch's allocator held above the start of one more (untimed) generate (GPU:
max_memory_allocated; CPU: the torch profiler's allocation events), which the planner's generation phase is
compared with, and the rise of the resident high-water mark during the timed calls (CPU: VmHWM, which also keeps
what the C library holds of freed buffers).

Usage:
    python scripts/benchmark/benchmark_generate.py                     # 8 x 512 Llama, 2 ranks, batch 8, 32 new tokens
    python scripts/benchmark/benchmark_generate.py --json gen.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SCRIPTS, "common"))
from peak_memory import allocated_peak, peak_bytes, reset_peak  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the sharded run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--batch", type=int, default=8, help="prompts per rank")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="new tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per setting (after a warm-up)")
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_generate")
    parser.add_argument("--grpo-steps", type=int, default=4, help="GRPO steps per setting (0: skip the GRPO rows)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "sharded" | "unsharded"
    return parser.parse_args(argv)


def build(path: str, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def prompts(args: argparse.Namespace, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g)


def timed(generate, ids, args: argparse.Namespace, warm: bool = True) -> tuple[list[float], list]:
    """A warm-up (unless `warm` is False: done already), then `repeats` timed greedy generates; the last's tokens."""
    import torch

    with torch.no_grad():
        if warm:
            generate(ids, max_new_tokens=args.new, do_sample=False, min_new_tokens=args.new)
        times, out = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = generate(ids, max_new_tokens=args.new, do_sample=False, min_new_tokens=args.new)
            times.append(time.perf_counter() - start)
    return times, out.tolist()


def tokenizer(vocab: int):
    """A word-level tokenizer over the model's vocabulary ('t0'..), built locally: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def grpo_worker(args: argparse.Namespace) -> None:
    """GRPO steps (generate 4 completions per prompt, score, update): plain TRL in one process or sharded."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    half = args.vocab // 2

    def reward(completions, **kwargs):
        return [
            sum(w[1:].isdigit() and int(w[1:]) < half for w in c.split()) / max(len(c.split()), 1) for c in completions
        ]

    prompts = Dataset.from_dict(
        {"prompt": [" ".join(f"t{3 + (i * 7 + j) % 900}" for j in range(args.prompt)) for i in range(256)]}
    )
    config = GRPOConfig(
        os.path.join(args.workdir, "grpo"), per_device_train_batch_size=args.batch * args.ranks // world,
        num_generations=4, max_completion_length=args.new, max_steps=args.grpo_steps, learning_rate=1e-5,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, bf16=False,
        gradient_checkpointing=False,
    )  # fmt: skip
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times[-1] = time.perf_counter() - times[-1]

    common = dict(reward_funcs=reward, args=config, train_dataset=prompts, processing_class=tokenizer(args.vocab),
                  callbacks=[Clock()])  # fmt: skip
    path = os.path.join(args.workdir, "model")
    if args.worker == "grpo_plain":
        GRPOTrainer(model=path, **common).train()
        _write(args, "grpo_plain", {"step_s": times})
        return
    import hf_fsdp2
    from hf_fsdp2.trl import FSDP2GRPOTrainer

    fsdp2 = hf_fsdp2.FSDP2Config(consolidate_on_train_end=False, checkpoint_on_signals=[])
    FSDP2GRPOTrainer(model=path, fsdp2_config=fsdp2, **common).train()
    rows = [None] * world
    dist.all_gather_object(rows, times)
    if dist.get_rank() == 0:
        _write(args, "grpo_sharded", {"step_s": [max(r[i] for r in rows) for i in range(len(times))]})


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_fsdp2
    from hf_fsdp2.sharding.gathering import gathered_bytes

    if args.worker.startswith("grpo"):
        return grpo_worker(args)
    path = os.path.join(args.workdir, "model")
    if args.worker == "unsharded":
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        result = {"times": [], "tokens": []}
        for rank in range(args.ranks):
            times, tokens = timed(model.generate, prompts(args, rank), args)
            result["times"] += times
            result["tokens"].append(tokens)
        _write(args, "unsharded", result)
        return
    if args.worker == "unsharded_at_once":  # what N independent processes (DDP's replicas) get on this machine
        from hf_fsdp2.distributed import init_distributed

        init_distributed()
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        times, _ = timed(model.generate, prompts(args, dist.get_rank()), args)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, times)
        if dist.get_rank() == 0:
            _write(args, "unsharded_at_once", {"times": [max(r[i] for r in rows) for i in range(len(times))]})
        return
    results = {}
    for gather in (True, False):
        config = hf_fsdp2.FSDP2Config(gather_for_generate=gather)
        model = hf_fsdp2.prepare_model(hf_fsdp2.from_pretrained(path), config).eval()
        ids = prompts(args, dist.get_rank())
        with torch.no_grad():  # the warm-up: first-call allocations (lazy imports, thread pools) are not generate's
            model.generate(ids, max_new_tokens=args.new, do_sample=False, min_new_tokens=args.new)
        before = reset_peak()
        times, tokens = timed(model.generate, ids, args, warm=False)
        peak = peak_bytes() - before
        with torch.no_grad():  # untimed: the profiler that counts allocations slows the call down
            call = functools.partial(model.generate, ids, max_new_tokens=args.new, do_sample=False)
            allocated = allocated_peak(functools.partial(call, min_new_tokens=args.new))
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, {"times": times, "tokens": tokens, "peak": peak, "allocated": allocated})
        results["gathered" if gather else "per_token"] = {
            "times": [max(r["times"][i] for r in rows) for i in range(len(times))],  # the slowest rank
            "tokens": [r["tokens"] for r in rows],
            "peak_mib": max(r["peak"] for r in rows) / 2**20,
            "allocated_peak_mib": max(r["allocated"] for r in rows) / 2**20,
            "gathered_mib": gathered_bytes(model) / 2**20,
        }
        del model
    if dist.get_rank() == 0:
        _write(args, "sharded", results)


def _write(args: argparse.Namespace, name: str, result: dict) -> None:
    with open(os.path.join(args.workdir, f"{name}.json"), "w") as f:
        json.dump(result, f)


def planned_mib(args: argparse.Namespace) -> float:
    """What `hf-fsdp2 plan --generate` adds above the resident shards: the larger of its two generation phases
    (gathering: the model and one unit's all-gather buffers; tokens: the model, KV cache, prefill)."""
    from hf_fsdp2.planning.memory_plan import plan

    result = plan(
        os.path.join(args.workdir, "model"), nproc=args.ranks, batch=args.batch, seq=args.prompt,
        generate_tokens=args.new, device_memory=2**40,
    )  # fmt: skip
    added = ("gathered model", "all-gather buffers of one unit", "KV cache", "prefill temporaries")
    phases = [p for p in result.phases if p.name.startswith("generation")]
    return max(sum(v for k, v in p.parts.items() if k in added) for p in phases) / 2**20


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.isfile(os.path.join(args.workdir, "model", "config.json")):
        build(os.path.join(args.workdir, "model"), args)
    names = ("layers", "hidden", "vocab", "batch", "prompt", "new", "repeats", "workdir", "ranks", "grpo_steps")
    flags = [x for n in names for x in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    quiet = dict(check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([sys.executable, __file__, "--worker", "unsharded", *flags], **quiet)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}"]
    subprocess.run([*launcher, __file__, "--worker", "sharded", *flags], **quiet)
    subprocess.run([*launcher, __file__, "--worker", "unsharded_at_once", *flags], **quiet)
    with open(os.path.join(args.workdir, "unsharded_at_once.json")) as f:
        at_once = json.load(f)
    with open(os.path.join(args.workdir, "unsharded.json")) as f:
        reference = json.load(f)
    with open(os.path.join(args.workdir, "sharded.json")) as f:
        sharded = json.load(f)
    one = statistics.median(reference["times"])
    print(
        f"Llama {args.layers} x {args.hidden}, vocab {args.vocab}: greedy generate of {args.new} tokens, "
        f"batch {args.batch} x {args.prompt}-token prompts per rank, {args.ranks} ranks vs one process"
    )
    both = statistics.median(at_once["times"])
    print(f"| setting | median s (min-max) | vs one process | vs {args.ranks} unsharded processes | same tokens | "
          "peak allocated (MiB) | VmHWM rise (MiB) |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|---:|")
    print(f"| unsharded, one process (per batch) | {one:.3f} ({min(reference['times']):.3f}-"
          f"{max(reference['times']):.3f}) | 1.00x | - | - | - | - |")  # fmt: skip
    print(f"| unsharded, {args.ranks} processes at once (each its batch) | {both:.3f} ({min(at_once['times']):.3f}-"
          f"{max(at_once['times']):.3f}) | {both / one:.2f}x | 1.00x | - | - | - |")  # fmt: skip
    for name, label in (("gathered", "sharded, gathered once per generate"), ("per_token", "sharded, per token")):
        r = sharded[name]
        median = statistics.median(r["times"])
        same = r["tokens"] == reference["tokens"]
        print(
            f"| {label} | {median:.3f} ({min(r['times']):.3f}-{max(r['times']):.3f}) | {median / one:.2f}x | "
            f"{median / both:.2f}x | {'yes' if same else '**no**'} | {r['allocated_peak_mib']:.0f} | "
            f"{r['peak_mib']:.0f} |"
        )
    planned = planned_mib(args)
    measured = sharded["gathered"]["allocated_peak_mib"]
    print(f"\nThe gathered model adds {sharded['gathered']['gathered_mib']:.0f} MiB per rank while generate runs; "
          f"the planner's generation phase adds {planned:.0f} MiB above the shards: {planned / measured:.2f}x the "
          "measured peak allocated (the VmHWM rise also holds freed buffers the C library keeps).")  # fmt: skip
    sharded["planned_mib"] = planned
    if args.grpo_steps:
        subprocess.run([sys.executable, __file__, "--worker", "grpo_plain", *flags], **quiet)
        subprocess.run([*launcher, __file__, "--worker", "grpo_sharded", *flags], **quiet)
        grpo = {}
        for name in ("grpo_plain", "grpo_sharded"):
            with open(os.path.join(args.workdir, f"{name}.json")) as f:
                grpo[name] = statistics.median(json.load(f)["step_s"][1:])  # the first step warms up
        print(
            f"\nGRPO step ({args.batch * args.ranks} completions of {args.new} tokens, 4 per prompt, then the update), "
            f"median of steps 2-{args.grpo_steps}: one process {grpo['grpo_plain']:.2f} s, {args.ranks} ranks sharded "
            f"{grpo['grpo_sharded']:.2f} s ({grpo['grpo_sharded'] / grpo['grpo_plain']:.2f}x)."
        )
        sharded["grpo_step_s"] = grpo
    if args.json:
        with open(args.json, "w") as f:
            saved = {"args": vars(args), "unsharded": reference, "unsharded_at_once": at_once, "sharded": sharded}
            json.dump(saved, f, indent=1)


if __name__ == "__main__":
    main()
