"""What scenario workers share: turning a trained model into comparable numbers, and the run loop."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainingArguments

# Adam's epsilon in every run whose weights are compared element-wise with another run's.
#
# Adam's step is lr * m / (sqrt(v) + eps): at the default eps=1e-8 it is (almost) blind to the gradient's size, so
# an element whose gradient is rounding noise (an attention key bias, which the softmax cancels exactly; a
# coordinate whose contributions happen to cancel) steps by about the learning rate in a direction set by how the
# CPU summed (AVX2 and AVX-512 kernels, one rank or two, sum in other orders): such comparisons held only by the
# luck of the rounding (issue 21: two failed on an AVX2 machine). The step's derivative in the gradient is of
# order 1/eps, so with eps=1e-3 two runs whose float32 gradients differ by rounding (|dg| ~ 1e-9) drift apart by
# about steps * lr * |dg| / eps <= 12 * 0.05 * 1e-6 < 1e-6 in these runs, inside the 1e-5 the tests compare at, on
# any CPU. Real differences still show, more than with the default: Adam is then no longer blind to a gradient's
# scale (a gradient off by a factor of 2 moves weights apart by a few percent of lr per step).
PARITY_ADAM_EPSILON = 1e-3


def parity_arguments(output_dir: str, per_device: int, **overrides: Any) -> TrainingArguments:
    """Arguments of a parity run (fp32 on the CPU, constant learning rate, a loss every step): `per_device` is the
    global batch over the world size, so every world size trains on the same batches."""
    values: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        max_steps=4,
        learning_rate=1e-2,
        adam_epsilon=PARITY_ADAM_EPSILON,  # compared element-wise across world sizes: see its definition
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def full_weights(model: nn.Module, trainable_only: bool = False) -> dict[str, list[float]]:
    """Every parameter as a flat list (gathered from the shards; NOTE: collective)."""
    out = {}
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        out[name.removeprefix("module.")] = tensor.detach().float().flatten().tolist()
    return out


def losses(trainer: Trainer) -> list[float]:
    """The logged training losses, in step order."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def saved_tensors(directory: str) -> dict[str, list[float]]:
    """Every tensor of a folder's safetensors files, flattened."""
    out: dict[str, list[float]] = {}
    for name in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        out.update({k: v.float().flatten().tolist() for k, v in load_file(os.path.join(directory, name)).items()})
    return out


def saved_configs(directory: str) -> dict[str, Any]:
    """config.json and generation_config.json of a saved folder, as dicts (those it has)."""
    out = {}
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(directory, name)):
            with open(os.path.join(directory, name)) as f:
                out[name] = json.load(f)
    return out


def run_scenarios(scenarios: dict[str, Callable[[], dict[str, Any]]], chosen: list[str], result_file: str) -> None:
    """Run each chosen scenario, recording its numbers or its error; rank 0 writes them all as JSON."""
    results: dict[str, Any] = {}
    for name in chosen or list(scenarios):
        started = time.perf_counter()
        try:
            results[name] = scenarios[name]()
        except Exception as error:  # recorded, so one broken scenario does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            print(results[name]["traceback"], file=sys.stderr, flush=True)
        print(f"scenario {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(result_file, "w") as f:
            json.dump(results, f)
    assert all(math.isfinite(v) for r in results.values() for v in r.get("losses", []))


def main_with_batches(run_one: Callable[[list[str]], None]) -> None:
    """Run the worker once with its command-line flags, or with `--batch FILE` once per flag list in that
    JSON file, one after another in this process group (a launch costs more than a tiny run).

    In a batch, a run that raises (on every rank alike: the refusals under test do) leaves its message in
    OUT/error.txt and the batch goes on.
    """
    if sys.argv[1:2] != ["--batch"]:
        run_one(sys.argv[1:])
        return
    with open(sys.argv[2]) as f:
        runs = json.load(f)
    for argv in runs:
        try:
            run_one(argv)
        except Exception as error:
            out = argv[argv.index("--out") + 1]
            os.makedirs(out, exist_ok=True)
            if int(os.environ.get("RANK", "0")) == 0:
                with open(os.path.join(out, ERROR_FILE), "w") as f:
                    f.write(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
            print(traceback.format_exc(), file=sys.stderr, flush=True)


ERROR_FILE = "error.txt"
