"""Parts "parity", "throughput", "compile", "qlora", "long_rows" (and the runs of "fp8" and "offload"): one training
run per spec, with FSDP2Trainer, plain Trainer or Trainer + Accelerate's FSDP2 plugin, and their tables.

A spec's `compile` is each system's own switch: FSDP2Config(compile=True) for ours (each block compiled, then
sharded), TrainingArguments(torch_compile=True) for the others (Trainer and Accelerate compile the whole model)."""

from __future__ import annotations

import os
import time
from typing import Any

from gpu_parts.common import (
    BF16_REL_TOLERANCE,
    FP32_TOLERANCE,
    PEAK_BF16,
    dataset,
    memory_mark,
    model_path,
    reset_memory_mark,
    training_arguments,
)


def hf_fsdp2_trainer(spec: dict, data: Any, out: str, callbacks: list, **config: Any) -> Any:
    """FSDP2Trainer as a user writes it: the model path, or (adapters) a PeftModel over from_pretrained."""
    import torch
    from benchmark_systems import LORA
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    import hf_fsdp2

    config |= dict(consolidate_on_train_end=False, fsdp_activation_checkpointing=spec.get("ac", False))
    config |= dict(compile=spec.get("compile", False), cpu_offload=spec.get("offload", False))
    config |= dict(loss_chunk_size=spec.get("chunk"), float8=spec.get("float8", False))
    fsdp2_config = hf_fsdp2.FSDP2Config(**config)
    args = training_arguments(spec, out)
    model: Any = model_path(spec["model"])
    if spec.get("adapter"):
        nf4 = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if spec.get("bf16") else torch.float32,
        )  # fmt: skip
        base = hf_fsdp2.from_pretrained(model, quantization_config=nf4 if spec["adapter"] == "qlora" else None)
        model = get_peft_model(base, LoraConfig(**LORA))
    return hf_fsdp2.FSDP2Trainer(model, args, fsdp2_config=fsdp2_config, train_dataset=data, callbacks=callbacks)


def compile_switch(spec: dict) -> dict[str, Any]:
    """The peers' own compile switch, on the spec's backend when it names one (the CPU rehearsal's aot_eager)."""
    if not spec.get("compile"):
        return {"torch_compile": False}
    return {"torch_compile": True, **({"torch_compile_backend": spec["backend"]} if spec.get("backend") else {})}


def plain_trainer(spec: dict, data: Any, out: str, callbacks: list) -> Any:
    """Plain Trainer on one device: fp32 weights, bf16 autocast when asked (what `bf16=True` gives)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    model = AutoModelForCausalLM.from_pretrained(model_path(spec["model"]), dtype=torch.float32)
    args = training_arguments(spec, out, gradient_checkpointing=spec.get("ac", False), **compile_switch(spec))
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def accelerate_trainer(spec: dict, data: Any, out: str, callbacks: list) -> Any:
    """Trainer + Accelerate's FSDP2 plugin (the benchmark's configuration), activation checkpointing as asked; with
    `fp8`, Accelerate's FP8 through torchao (`accelerate_fp8`)."""
    import torch
    from benchmark_systems import AccelerateFSDP2Trainer
    from transformers import AutoModelForCausalLM

    fsdp_config = {
        "version": 2, "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": not spec.get("fp8"),
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
        "activation_checkpointing": spec.get("ac", False),
    }  # fmt: skip
    args = training_arguments(spec, out, fsdp=True, fsdp_config=fsdp_config, **compile_switch(spec))
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    model = AutoModelForCausalLM.from_pretrained(model_path(spec["model"]), dtype=torch.float32)
    trainer_class = accelerate_fp8(AccelerateFSDP2Trainer) if spec.get("fp8") else AccelerateFSDP2Trainer
    return trainer_class(model=model, args=args, train_dataset=data, callbacks=callbacks)


def accelerate_fp8(base: type) -> type:
    """Trainer + Accelerate's FSDP2 plugin with Accelerate's own FP8: `mixed_precision="fp8"` and its torchao recipe
    (`AORecipeKwargs()`: its defaults, FP8 all-gather on, every Linear but the first and the last converted), which
    Trainer has no argument for. Accelerate refuses its torchao FP8 with RAM-efficient loading, so that is off."""
    from accelerate.utils import AORecipeKwargs

    class AccelerateFP8Trainer(base):
        def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
            args = super()._build_accelerator_args(**kwargs)
            return {**args, "mixed_precision": "fp8", "kwargs_handlers": [*args["kwargs_handlers"], AORecipeKwargs()]}

    return AccelerateFP8Trainer


def probe(record: dict, start: float, baseline: float) -> Any:
    """A callback marking the end of loading, each step's time and loss."""
    import torch
    from transformers import TrainerCallback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            sync()
            record["load_s"] = round(time.perf_counter() - start, 3)
            record["load_peak_mib"] = round(memory_mark() - baseline, 1)
            if torch.cuda.is_available():  # on the CPU the mark goes on from the load: VmHWM cannot drop below RSS
                reset_memory_mark()

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            sync()
            self.step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            sync()
            record["step_s"].append(round(time.perf_counter() - self.step_start, 4))

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                record["losses"].append(float(logs["loss"]))

    return Probe()


BUILDERS = {"hf_fsdp2": hf_fsdp2_trainer, "trainer": plain_trainer, "accelerate": accelerate_trainer}


def train(spec: dict, callbacks: tuple[Any, ...] = (), built: Any = None) -> dict:
    """Load and train one configuration; load time and peak, step times, losses, training peak, tokens/s (a part's
    own `callbacks` record more; `built`, if given, is called with the trainer before it trains)."""
    import statistics

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path(spec["model"])).vocab_size
    data = dataset(spec, vocab)
    record: dict[str, Any] = {"step_s": [], "losses": []}
    out = os.path.join(os.environ["GPU_CHECK_WORKDIR"], "runs", spec["part"], spec["name"].replace(" ", "_"))
    baseline = reset_memory_mark()
    probes = [probe(record, time.perf_counter(), baseline), *callbacks]
    trainer = BUILDERS[spec.get("system", "hf_fsdp2")](spec, data, out, probes)
    if built is not None:
        built(trainer)
    trainer.train()
    record["train_peak_mib"] = round(memory_mark() - baseline, 1)
    timed = record["step_s"][spec["warmup"] :] or record["step_s"]
    record["step_median_s"] = round(statistics.median(timed), 4)
    record["tokens_per_s"] = round(spec["batch"] * spec["seq"] / record["step_median_s"], 1)
    del trainer
    return record


def run_ok(run: dict) -> bool:
    return "error" not in run


def parity_table(part: dict) -> list[str]:
    """FSDP2Trainer's loss curve against plain Trainer's, per precision."""
    runs = part.get("runs", {})
    lines = [
        "",
        "| parity (100M, 20 steps) | max abs loss difference | tolerance | first → last loss |",
        "|---|---:|---:|---|",
    ]
    for precision in ("bf16", "fp32"):
        ours, theirs = runs.get(f"hf_fsdp2 {precision}", {}), runs.get(f"trainer {precision}", {})
        if not (run_ok(ours) and run_ok(theirs) and ours.get("losses") and theirs.get("losses")):
            lines.append(f"| {precision} | not measured | | |")
            continue
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        tolerance = BF16_REL_TOLERANCE * max(theirs["losses"]) if precision == "bf16" else FP32_TOLERANCE
        verdict = "within" if diff <= tolerance else "**outside**"
        curve = f"{ours['losses'][0]:.3f} → {ours['losses'][-1]:.3f}"
        lines.append(f"| {precision} | {diff:.2e} ({verdict}) | {tolerance:.1e} | {curve} |")
    return lines


def mfu(run: dict, env: dict) -> float | None:
    """Model FLOPs utilisation of a training run against the GPU's dense bf16 peak."""
    peak = next((v for k, v in PEAK_BF16.items() if k in env.get("device_name", "")), None)
    model = env.get("models", {}).get(run.get("spec", {}).get("model", ""))
    if peak is None or model is None or "tokens_per_s" not in run:
        return None
    computing = model["params"] - (0 if model["tied"] else model["vocab"] * model["hidden"])
    per_token = 6 * computing + 12 * model["layers"] * model["hidden"] * run["spec"]["seq"]
    return run["tokens_per_s"] * per_token / peak


def throughput_table(parts: dict, env: dict) -> list[str]:
    """Tokens/s, MFU and peak memory of every 1B full fine-tuning run."""
    lines = ["", "| 1B, 4 x 2048 tokens, bf16 | tokens/s | MFU | peak allocated |", "|---|---:|---:|---:|"]
    for part in ("throughput", "compile", "offload"):
        for name, run in parts.get(part, {}).get("runs", {}).items():
            if part == "compile" and compile_table(parts, env):
                continue  # the peers' compiled runs are there: in that table, with ratios
            if part == "offload" and not run.get("spec", {}).get("offload"):
                continue  # the part's on-GPU reference and its host AdamW timings have tables of their own
            if not run_ok(run):
                lines.append(f"| {name} | failed: {run['error'][:80]} | | |")
                continue
            share = mfu(run, env)
            mfu_text = f"{share:.1%}" if share is not None else "n/a"
            lines.append(f"| {name} | {run['tokens_per_s']:,.0f} | {mfu_text} | {run['train_peak_mib']:,.0f} MiB |")
    return lines


def compile_table(parts: dict, env: dict) -> list[str]:
    """Each system compiled with its own switch, side by side: tokens/s, MFU, peak, the speed-up over its own eager
    run (part throughput), and ours over it. None when part compile has no peer's run (records before issue 63)."""
    runs = parts.get("compile", {}).get("runs", {})
    if not any(name != "hf_fsdp2 compile" for name in runs):
        return []
    eager = parts.get("throughput", {}).get("runs", {})
    ours = runs.get("hf_fsdp2 compile", {})
    lines = [
        "",
        "| compiled, side by side (1B, 4 x 2048 tokens, bf16) | tokens/s | MFU | peak allocated | ÷ its eager run "
        "| hf_fsdp2 compile ÷ this |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in runs.items():
        if not run_ok(run):
            lines.append(f"| {name} | failed: {run['error'][:80]} | | | | |")
            continue
        share = mfu(run, env)
        base = eager.get(name.removesuffix(" compile"), {})
        speedup = f"{run['tokens_per_s'] / base['tokens_per_s']:.2f}×" if "tokens_per_s" in base else "n/a"
        ratio = f"{ours['tokens_per_s'] / run['tokens_per_s']:.3f}×" if "tokens_per_s" in ours else "n/a"
        lines.append(
            f"| {name} | {run['tokens_per_s']:,.0f} | {f'{share:.1%}' if share is not None else 'n/a'} | "
            f"{run['train_peak_mib']:,.0f} MiB | {speedup} | {ratio} |"
        )
    return lines


def simple_table(parts: dict, part: str, keys: list[str]) -> list[str]:
    """One row per run of `part`, the given figures as columns."""
    runs = parts.get(part, {}).get("runs", {})
    if not runs:
        return []
    lines = ["", f"| {part} | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, run in runs.items():
        cells = [f"{run[k]:,}" if k in run else "failed" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
