"""What keeping a VLM's vision tower in the root unit costs, against sharding it layer by layer.

Layer-by-layer sharding (FSDP2's default for `_no_split_modules` blocks) works only while every rank holds an
image in every step: a text-only batch on one rank leaves the ranks in different collectives. hf_fsdp2 keeps
the tower (and projector) in the root unit instead, gathered with it at each forward. This script measures the
price on batches where every row holds an image (so both can run): step time and per-rank peak RSS above the
after-import baseline, for a frozen and a trainable tower, on a mid-size LLaVA built from a config.

Usage:
    python scripts/measure/measure_vlm_branches.py [--ranks 2] [--steps 6] [--json out.json]
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
from peak_memory import MIB, vm_kib  # noqa: E402

IMAGE, PATCH = 64, 8  # 64 patches per image


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--workdir", default="/tmp/hf_fsdp2_vlm_branches")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "root,frozen" etc.
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(path: str) -> None:
    """A LLaVA with an 8-layer CLIP tower (hidden 512) and an 8-layer Llama (hidden 512): ~25M + ~30M."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, image_size=IMAGE,
        patch_size=PATCH,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=1024,
    )  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=7999, vision_feature_layer=-1)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    """One measured run on this rank: baseline RSS, train `steps` steps, report step time and peak."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    import hf_fsdp2.model
    import hf_fsdp2.sharding.units
    from hf_fsdp2 import FSDP2Trainer

    placement, tower = args.worker.split(",")
    if placement == "per-layer":  # what FSDP2 does by default: the tower's layers are units of their own
        hf_fsdp2.sharding.units.branch_names = hf_fsdp2.model.branch_names = lambda model, named: []
    baseline = vm_kib("VmRSS")
    tokens = (IMAGE // PATCH) ** 2
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.batch * args.ranks * args.steps):
        ids = torch.randint(3, 7999, (args.seq,), generator=g)
        ids[1 : 1 + tokens] = 7999
        labels = torch.where(ids == 7999, -100, ids)
        rows.append({"input_ids": ids, "labels": labels, "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g)})

    def collate(batch: list[dict]) -> dict:
        return {k: torch.stack([torch.as_tensor(r[k]) for r in batch]) for k in batch[0]}

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    training = TrainingArguments(
        output_dir=os.path.join(args.workdir, "out"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False, logging_steps=100,
    )  # fmt: skip
    model = hf_fsdp2.from_pretrained(os.path.join(args.workdir, "llava"))  # the meta skeleton
    if tower == "frozen":
        model.get_encoder("image").requires_grad_(False)
    trainer = FSDP2Trainer(
        model=model, args=training, train_dataset=Dataset.from_list(rows).with_format("torch"),
        data_collator=collate, callbacks=[Clock()], fsdp2_config=hf_fsdp2.FSDP2Config(consolidate_on_train_end=False),
    )  # fmt: skip
    trainer.train()
    steady = sorted(times[1:])
    result = {"step_s": steady[len(steady) // 2], "peak_mib": (vm_kib("VmHWM") - baseline) * 1024 / MIB}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, result)
    if torch.distributed.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump(
                {"step_s": max(r["step_s"] for r in gathered), "peak_mib": max(r["peak_mib"] for r in gathered)}, f
            )


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.isdir(os.path.join(args.workdir, "llava")):
        build(os.path.join(args.workdir, "llava"))
    rows = []
    for tower in ("frozen", "trainable"):
        for placement in ("per-layer", "root"):
            result = os.path.join(args.workdir, f"{placement}-{tower}.json")
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                __file__, "--worker", f"{placement},{tower}", "--result", result, "--workdir", args.workdir,
                "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                "--ranks", str(args.ranks),
            ]  # fmt: skip
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            with open(result) as f:
                rows.append({"tower": tower, "placement": placement, **json.load(f)})
    setting = f"{args.ranks} ranks, batch {args.batch} x seq {args.seq}, every row an image"
    print(f"\nLLaVA (CLIP 8x512 + Llama 8x512), {setting}")
    print("| tower | placement | step (median, s) | peak RSS above baseline, worst rank (MiB) |")
    print("|---|---|---:|---:|")
    for row in rows:
        print(f"| {row['tower']} | {row['placement']} | {row['step_s']:.3f} | {row['peak_mib']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
