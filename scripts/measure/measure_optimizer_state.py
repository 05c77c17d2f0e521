"""Optimizer state bytes per rank under FSDP2Trainer, per memory-lean optimizer, against AdamW and the planner.

Each optimizer trains a Llama (hidden 256, 4 layers, vocabulary 4096: every matrix is large enough for torchao to
quantise) for 6 steps at `--nproc` ranks, in a launch of its own with its own compile cache (torchao's 8- and
4-bit states collide in a shared one). Rank 0 sums the bytes of its state tensors (the local shards; torchao's
codes and scales) and the planner's figure for the same model; the table prints both as multiples of AdamW's.
Beside them, per rank: the training peak (VmHWM above the after-import baseline), the median time of steps 3-6,
and the bytes the optimizer step itself sends through torch.distributed (Muon's gathers and scatters, Adafactor's
statistics; counted at the collective calls between Trainer's pre- and post-optimizer-step events).

Usage:
    python scripts/measure/measure_optimizer_state.py [--nproc 2] [--out scripts/results/optimizer_state.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

OPTIMS = [
    "adamw_torch", "adafactor", "adamw_torch_8bit", "adamw_torch_4bit", "lion_32bit", "schedule_free_adamw", "muon",
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="scripts/results/optimizer_state.json")
    parser.add_argument("--from-json", default=None, help="print the docs table of a results file, run nothing")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(folder: str) -> str:
    """Save the measured Llama once (random weights; nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def state_bytes_of(optimizer: object) -> int:
    """Bytes of this rank's optimizer state tensors (DTensors: their local shard; torchao: codes and scales)."""
    import torch
    from torch.distributed.tensor import DTensor

    def size(tensor: torch.Tensor) -> int:
        if isinstance(tensor, DTensor):
            return size(tensor.to_local())
        if hasattr(tensor, "__tensor_flatten__") and type(tensor) is not torch.Tensor:
            return sum(size(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
        return tensor.numel() * tensor.element_size()

    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(size(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0)


COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "gather", "scatter", "all_reduce", "all_to_all_single")


def count_step_collectives(counter: dict[str, Any]) -> None:
    """Count the tensor bytes this rank passes to torch.distributed's collectives while counter["on"] is set."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(tensor: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if counter["on"]:
                counter["bytes"] += tensor.numel() * tensor.element_size()
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, counted)


def step_probe(record: dict[str, Any], counter: dict[str, Any]) -> Any:
    """A callback timing each step and switching the collective counter on around the optimizer step."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
            counter["on"], counter["bytes"] = True, 0

        def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
            counter["on"] = False
            record["step_bytes"].append(counter["bytes"])

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            record["step_s"].append(time.perf_counter() - self.start)

    return Probe()


def vm_hwm_kib() -> int:
    """This process's peak resident set (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def worker(optim: str, model: str, out: str) -> None:
    """One rank: train 6 steps with `optim`; rank 0 writes measured and planned bytes, peak and step time."""
    import statistics

    import torch
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_fsdp2 import FSDP2Trainer, Muon
    from hf_fsdp2.planning.model_sizes import model_sizes
    from hf_fsdp2.planning.phases import phases_for
    from hf_fsdp2.planning.plan_types import PlanRequest

    baseline = vm_hwm_kib()
    record: dict[str, Any] = {"step_s": [], "step_bytes": []}
    counter: dict[str, Any] = {"on": False, "bytes": 0}
    count_step_collectives(counter)

    ids = torch.randint(3, 4096, (16, 32)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=6, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, optim="adamw_torch" if optim == "muon" else optim,
    )  # fmt: skip
    extra = {"optimizer_cls_and_kwargs": (Muon, {"lr": 0.02})} if optim == "muon" else {}
    trainer = FSDP2Trainer(model, args, train_dataset=data, callbacks=[step_probe(record, counter)], **extra)
    trainer.train()
    measured = state_bytes_of(trainer.optimizer)
    peak_mib = (vm_hwm_kib() - baseline) / 1024
    nproc = int(os.environ["WORLD_SIZE"])
    sizes = model_sizes(PlanRequest(model, nproc=nproc, optim=optim))
    planned = next(
        p.parts["optimizer state"]
        for p in phases_for(PlanRequest(model, nproc=nproc, optim=optim), sizes, 0)
        if "optimizer state" in p.parts
    )
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            row = {"optim": optim, "measured_bytes": measured, "planned_bytes": planned, "train_peak_mib": peak_mib}
            row |= {"step_median_s": statistics.median(record["step_s"][2:]), "step_bytes": record["step_bytes"][-1]}
            json.dump(row, f)


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """The docs table (docs/full-finetuning.md) of a results file's rows."""
    lines = [
        "| optim | state per rank | × AdamW | planner / measured | training peak | step (median) "
        "| sent by the optimizer step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['optim']}` | {r['measured_bytes'] / 2**20:.2f} MiB | {r['vs_adamw']:.3f} | "
            f"{r['planned_over_measured']:.2f} | {r['train_peak_mib']:.0f} MiB | {r['step_median_s']:.3f} s | "
            f"{r['step_bytes'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            return print(render_markdown(json.load(f)["rows"]))
    if args.worker:
        worker(args.worker, args.model, args.out)
        return
    work = tempfile.mkdtemp(prefix="hf_fsdp2_optimizer_state_")
    model = build_model(os.path.join(work, "llama"))
    rows = []
    for optim in OPTIMS:
        result = os.path.join(work, f"{optim}.json")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, f"inductor-{optim}"), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        command += [os.path.abspath(__file__), "--worker", optim, "--model", model, "--out", result]
        subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        with open(result) as f:
            rows.append(json.load(f))
    adamw = next(r for r in rows if r["optim"] == "adamw_torch")
    print(f"Optimizer state per rank at {args.nproc} ranks (rank 0), as a multiple of AdamW's:")
    print(f"{'optim':<22}{'measured MiB':>14}{'x AdamW':>9}{'planned MiB':>13}{'planned/measured':>18}", end="")
    print(f"{'peak MiB':>10}{'step s':>8}{'step MiB sent':>15}")
    for row in rows:
        row["vs_adamw"] = row["measured_bytes"] / adamw["measured_bytes"]
        row["planned_over_measured"] = row["planned_bytes"] / row["measured_bytes"]
        print(
            f"{row['optim']:<22}{row['measured_bytes'] / 2**20:>14.2f}{row['vs_adamw']:>9.3f}"
            f"{row['planned_bytes'] / 2**20:>13.2f}{row['planned_over_measured']:>18.3f}"
            f"{row['train_peak_mib']:>10.0f}{row['step_median_s']:>8.3f}{row['step_bytes'] / 2**20:>15.2f}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"nproc": args.nproc, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
