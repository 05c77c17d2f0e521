"""One GPU, rank 0 of a world of one through torchrun (a real nccl group): FSDP2Trainer against plain Trainer on
the same GPU, per scenario. Writes OUT/one_gpu.json: each scenario's two loss curves, or its error.

Scenarios: fp32 and bf16 parity, a resume equal to the uninterrupted run, a QLoRA (NF4 on CUDA) base, cpu_offload
and compile=True, each against its unsharded reference.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from hf_fsdp2 import FSDP2Config, FSDP2Trainer, from_pretrained
from tests.workers.scenarios import PARITY_ADAM_EPSILON
from tests.workers.train_worker import make_dataset

MODEL, OUT = sys.argv[1:3]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to rehearse the worker
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def arguments(name: str, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = dict(
        output_dir=os.path.join(OUT, name), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-3,
        adam_epsilon=PARITY_ADAM_EPSILON, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], seed=42, disable_tqdm=True, use_cpu=DEVICE == "cpu",
    )  # fmt: skip
    return TrainingArguments(**{**values, **overrides})


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def plain(name: str, model: Any = None, **overrides: Any) -> list[float]:
    """Plain Trainer on the GPU: the reference."""
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(MODEL)
    trainer = Trainer(model, arguments(name, **overrides), train_dataset=make_dataset(24, 96))
    trainer.train()
    return losses(trainer)


def ours(name: str, model: Any = None, config: FSDP2Config | None = None, **overrides: Any) -> list[float]:
    trainer = FSDP2Trainer(
        model if model is not None else MODEL, arguments(name, **overrides), fsdp2_config=config,
        train_dataset=make_dataset(24, 96),
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=overrides.get("resume_from_checkpoint"))
    return losses(trainer)


def nf4_model() -> str:
    """A Llama whose every projection is large enough for NF4's blocks (hidden 256), saved under OUT."""
    path = os.path.join(OUT, "nf4_model")
    config = LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def qlora_pair() -> dict:
    """LoRA on an NF4 base: torchao's to_nf4 by hand on the GPU (reference) against from_pretrained's 4-bit base."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    path = nf4_model()
    torch.manual_seed(0)
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, target_modules=TARGETS))
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("base_layer"):
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach().to(DEVICE)), requires_grad=False)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    torch.manual_seed(0)
    model = get_peft_model(from_pretrained(path, quantization_config=bnb), LoraConfig(r=4, target_modules=TARGETS))
    return {"plain": plain("nf4-plain", reference), "ours": ours("nf4-ours", model)}


def resume_pair() -> dict:
    """6 uninterrupted steps against 3 steps, a checkpoint, and a fresh trainer resuming from it."""
    whole = ours("resume-whole")
    ours("resume-first", save_strategy="steps", save_steps=3, max_steps=3)
    checkpoint = os.path.join(OUT, "resume-first", "checkpoint-3")
    resumed = ours("resume-first", resume_from_checkpoint=checkpoint)
    return {"plain": whole[3:], "ours": resumed[3:]}  # a resumed trainer's log starts with the first 3 steps


SCENARIOS = {
    "fp32": lambda: {"plain": plain("fp32-plain"), "ours": ours("fp32-ours")},
    "bf16": lambda: {"plain": plain("bf16-plain", bf16=True), "ours": ours("bf16-ours", bf16=True)},
    "resume": resume_pair,
    "nf4": qlora_pair,
    "offload": lambda: {"plain": plain("offload-plain"), "ours": ours("offload", config=FSDP2Config(cpu_offload=True))},
    "compile": lambda: {"plain": plain("compile-plain"), "ours": ours("compile", config=FSDP2Config(compile=True))},
}


def main() -> None:
    results = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario()
        except Exception as error:  # noqa: BLE001 - each scenario reports on its own
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(OUT, "one_gpu.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
