"""FSDP2Config(float8=True) on the CPU: refused by name as a user meets it; then, with torchao's emulated FP8 matmuls
(`Float8LinearConfig(emulate=True)`, torchao's own test mode) and the machine check lifted, the whole path a GPU takes:
conversion before sharding, FP8 all-gather of each rank's cast shard, weights loaded, scales refreshed, trained,
checkpointed and exported.

Usage: float8_worker.py OUT MODEL; rank 0 writes OUT/float8-{WORLD}.json. Every run trains MODEL 4 steps on the same
global batch of 4 rows at any world size, in bf16.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torchao.float8 as torchao_float8
from datasets import Dataset
from torchao.float8.float8_linear import Float8Linear

import hf_fsdp2.model as model_module
from hf_fsdp2 import FSDP2Config, FSDP2Trainer
from hf_fsdp2.sharding.units import reshard_all
from tests.workers.scenarios import losses, parity_arguments, run_scenarios, saved_tensors

OUT, MODEL = sys.argv[1:3]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH = 4
RUN_DIR = os.path.join(OUT, f"float8-{WORLD}")


def rows() -> Dataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (GLOBAL_BATCH * 4, 32), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def train(name: str, float8: bool, accumulate: int = 1, **config: Any) -> FSDP2Trainer:
    """4 steps on the global batch of 4 rows, in `accumulate` micro-batches per rank."""
    torch.manual_seed(0)
    per_device = GLOBAL_BATCH // WORLD // accumulate
    args = parity_arguments(
        os.path.join(RUN_DIR, name), per_device, bf16=True, learning_rate=1e-3, gradient_accumulation_steps=accumulate
    )
    fsdp2 = FSDP2Config(float8=float8, **config)
    trainer = FSDP2Trainer(MODEL, args, fsdp2_config=fsdp2, train_dataset=rows())
    trainer.train()
    return trainer


def refused() -> dict[str, Any]:
    """As a user meets it: float8=True on this CPU machine."""
    try:
        train("refused", float8=True)
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}


def emulated() -> None:
    """From here on: torchao's emulated FP8 matmuls, and no machine check (the CPU has no FP8 tensor cores)."""
    config = torchao_float8.Float8LinearConfig
    torchao_float8.Float8LinearConfig = lambda **kwargs: config(emulate=True, **kwargs)
    model_module.check_float8_machine = lambda device: None


def bf16() -> dict[str, Any]:
    return {"losses": losses(train("bf16", float8=False, consolidate_on_train_end=False))}


def float8() -> dict[str, Any]:
    """Trained through FP8 (emulated), exported; then the scales a training forward uses, and a no-grad forward's."""
    trainer = train("float8", float8=True)
    model = trainer.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    first = next(iter(layers.values()))
    inputs = torch.tensor(rows()["input_ids"][:2])
    model.train()
    with torch.enable_grad():
        model(input_ids=inputs)
    scale = first.weight._local_tensor._precomputed_scale
    full = first.weight.full_tensor()
    full = getattr(full, "_tensor", full)  # torchao's weight wrapper, or the plain tensor it holds
    expected = torch.finfo(torch.float8_e4m3fn).max / float(full.abs().max().double())
    reshard_all(model)  # a forward without backward leaves the root and the last block gathered
    model.eval()
    with torch.no_grad():
        model(input_ids=inputs)
    reshard_all(model)
    return {
        "losses": losses(trainer),
        "layers": sorted(layers),
        "local_tensor": type(first.weight._local_tensor).__name__,
        "scale": None if scale is None else float(scale),
        "expected_scale": expected,
        "scales_after_no_grad": [_float(m.weight._local_tensor._precomputed_scale) for m in layers.values()],
        "exported": sorted(saved_tensors(os.path.join(RUN_DIR, "float8"))),
        "original": sorted(saved_tensors(MODEL)),
    }


def _float(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


def accumulated() -> dict[str, Any]:
    """One process with 2 ranks' micro-batches (2 rows each): each FP8 cast of an activation or gradient takes its
    scale from the rows it holds, so this, not one batch of 4, is what 2 ranks compute."""
    return {
        "float8": losses(train("float8_accumulated", float8=True, accumulate=2, consolidate_on_train_end=False)),
        "bf16": losses(train("bf16_accumulated", float8=False, accumulate=2, consolidate_on_train_end=False)),
    }


def resumed() -> dict[str, Any]:
    """Stopped after 2 steps (a sharded checkpoint of the FP8-trained model), resumed for the last 2."""
    torch.manual_seed(0)
    folder = os.path.join(RUN_DIR, "resumed")
    args = parity_arguments(folder, GLOBAL_BATCH // WORLD, bf16=True, learning_rate=1e-3, save_strategy="steps")
    args.save_steps = 2
    config = FSDP2Config(float8=True, consolidate_on_train_end=False)
    FSDP2Trainer(MODEL, args, fsdp2_config=config, train_dataset=rows()).train()
    trainer = FSDP2Trainer(MODEL, args, fsdp2_config=config, train_dataset=rows())
    trainer.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-2"))
    return {"losses": losses(trainer)}


SCENARIOS = {
    "refused": refused,
    "emulated": lambda: emulated() or {},
    "bf16": bf16,
    "float8": float8,
    "resumed": resumed,
}
if WORLD == 1:
    SCENARIOS["accumulated"] = accumulated

if __name__ == "__main__":
    torch.set_num_threads(1)
    run_scenarios(SCENARIOS, [], os.path.join(OUT, f"float8-{WORLD}.json"))
