"""QLoRA scripts as people write them, with the one-line switch: a 4-bit NF4 base and LoRA.

Usage: qlora_worker.py {plain,fsdp2} OUT MODEL [SCENARIO ...]. `plain` is the reference: one process, plain
`Trainer`, the same NF4 quantization done by hand on the whole weights (torchao's `to_nf4`), no FSDP. Rank 0
writes OUT/{mode}-{world}.json: scenario -> losses, LoRA weights, which base weights are NF4.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

from tests.workers.scenarios import PARITY_ADAM_EPSILON, full_weights, losses, run_scenarios, saved_tensors
from tests.workers.train_worker import make_dataset

MODE, OUT, MODEL = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=8, target_modules=TARGETS)
BNB = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def args(name: str, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = dict(
        output_dir=os.path.join(RUN_DIR, name), per_device_train_batch_size=4 // WORLD, max_steps=4,
        learning_rate=1e-2, adam_epsilon=PARITY_ADAM_EPSILON, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=3,
    )  # fmt: skip
    values.update(overrides)
    return TrainingArguments(**values)


def qlora_model(route: str = "bnb") -> torch.nn.Module:
    """The QLoRA model: by hand in one process (the reference), or as a user writes it for FSDP2Trainer."""
    torch.manual_seed(0)  # LoRA's initial values, the same in every run
    if MODE == "plain":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        model = get_peft_model(AutoModelForCausalLM.from_pretrained(MODEL), LoraConfig(**LORA))
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith("base_layer"):
                module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
        return model
    from hf_fsdp2 import from_pretrained

    base = from_pretrained(MODEL, quantization_config=BNB) if route == "bnb" else from_pretrained(MODEL)
    return get_peft_model(base, LoraConfig(**LORA))


def nf4_weights(model: torch.nn.Module) -> list[str]:
    return sorted(
        n for n, p in model.named_parameters() if type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor"
    )


# FSDP2Config options QLoRA runs with (the reference, one process without FSDP, is the same for each).
OPTIONS: dict[str, dict[str, Any]] = {
    "switch": dict(base_quantization="nf4"),
    "checkpointing": dict(fsdp_activation_checkpointing=True),
    "sequence_parallel": dict(sequence_parallel_size=2),  # right-padded rows split across the 2 ranks
    "compile": dict(compile=True),
}


def trainer(name: str, model: torch.nn.Module, **overrides: Any) -> Trainer:
    if MODE == "plain":
        return Trainer(model=model, args=args(name, **overrides), train_dataset=make_dataset(32, 96))
    from hf_fsdp2 import FSDP2Config, FSDP2Trainer

    config = FSDP2Config(**OPTIONS.get(name, {}), consolidate_on_train_end=False)
    return FSDP2Trainer(
        model=model, args=args(name, **overrides), train_dataset=make_dataset(32, 96), fsdp2_config=config
    )


def train(name: str, route: str = "bnb") -> dict[str, Any]:
    """Four steps of QLoRA: losses, gathered LoRA weights, the NF4 base weights."""
    run = trainer(name, qlora_model(route))
    run.train()
    return {
        "losses": losses(run),
        "weights": full_weights(run.model, trainable_only=True),
        "nf4": nf4_weights(run.model),
    }


def resume() -> dict[str, Any]:
    """Adapter-only checkpoints: a fresh run resumed from checkpoint-2 re-quantizes the base and goes on exactly."""
    first = trainer("resume", qlora_model(), save_strategy="steps", save_steps=2)
    first.train()
    again = trainer("resume", qlora_model(), save_strategy="no")
    again.train(resume_from_checkpoint=os.path.join(RUN_DIR, "resume", "checkpoint-2"))
    files = sorted(os.listdir(os.path.join(RUN_DIR, "resume", "checkpoint-2")))
    return {
        "losses": losses(first),
        "resumed": losses(again),
        "files": files,
        "weights": full_weights(again.model, trainable_only=True),
    }


def resume_elsewhere() -> dict[str, Any]:
    """The 2-rank run's adapter checkpoint-2 resumed at this world size: the base is re-quantized here."""
    again = trainer("resume_elsewhere", qlora_model(), save_strategy="no")
    again.train(resume_from_checkpoint=os.path.join(OUT, "fsdp2-2", "resume", "checkpoint-2"))
    return {"resumed": losses(again)}


def merged() -> dict[str, Any]:
    """merge_adapters_on_save: the dequantized base plus the merged adapter, against dequantize-then-merge by hand."""
    if MODE == "plain":
        run = trainer("merged", qlora_model())
        run.train()
        for module in run.model.modules():
            weight = module.weight if isinstance(module, torch.nn.Linear) else None
            if type(weight).__name__ == "NF4Tensor":
                module.weight = torch.nn.Parameter(weight.get_original_weight(), requires_grad=False)
        state = run.model.merge_and_unload().state_dict()
        return {"exported": {k: v.float().flatten().tolist() for k, v in state.items()}}
    from hf_fsdp2 import FSDP2Config, FSDP2Trainer

    config = FSDP2Config(merge_adapters_on_save=True, consolidate_on_train_end=False)
    run = FSDP2Trainer(
        model=qlora_model(), args=args("merged"), train_dataset=make_dataset(32, 96), fsdp2_config=config
    )
    run.train()
    export = os.path.join(RUN_DIR, "merged_export")
    run.save_model(export)
    return {"exported": saved_tensors(export) if int(os.environ.get("RANK", "0")) == 0 else {}}


def trl_run(kind: str) -> dict[str, Any]:
    """TRL's SFTTrainer or DPOTrainer with peft_config and `model_init_kwargs={"quantization_config": ...}`, the
    usual QLoRA script; the reference quantizes the same weights by hand before TRL adds the adapters (for DPO
    the adapter-disabled policy is the reference model)."""
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from tests.tiny_models import tiny_tokenizer
    from tests.workers.trl_worker import dpo_data, sft_data

    lora = LoraConfig(**LORA, lora_dropout=0.0, task_type="CAUSAL_LM")
    config = (SFTConfig if kind == "sft" else DPOConfig)(
        output_dir=os.path.join(RUN_DIR, kind), per_device_train_batch_size=4 // WORLD, max_steps=4,
        learning_rate=1e-2, adam_epsilon=PARITY_ADAM_EPSILON, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=3, bf16=False,
        gradient_checkpointing=False, max_length=32,
        model_init_kwargs={"quantization_config": BNB} if MODE == "fsdp2" else None,
    )  # fmt: skip
    data = sft_data() if kind == "sft" else dpo_data()
    torch.manual_seed(0)
    if MODE == "plain":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        model: Any = AutoModelForCausalLM.from_pretrained(MODEL)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in TARGETS:
                module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
        trainer_class: Any = SFTTrainer if kind == "sft" else DPOTrainer
    else:
        from hf_fsdp2.trl import FSDP2DPOTrainer, FSDP2SFTTrainer

        model, trainer_class = MODEL, FSDP2SFTTrainer if kind == "sft" else FSDP2DPOTrainer
    run = trainer_class(model, args=config, train_dataset=data, processing_class=tiny_tokenizer(), peft_config=lora)
    run.train()
    return {
        "losses": losses(run),
        "weights": full_weights(run.model, trainable_only=True),
        "nf4": nf4_weights(run.model),
    }


def failed_read(key: str) -> dict[str, Any]:
    """Rank 1 alone fails to read `key` (an I/O error injected into its reader): every rank must raise, naming
    it, instead of rank 0 waiting forever in the next collective (an NF4 weight: its absmax all-gather)."""
    from hf_fsdp2.loading.safetensors_reader import SliceReader

    original = SliceReader.read_data

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        if any(item.storage_index.fqn == key for item in plan.items):
            raise OSError("injected: the disk went away")
        return original(self, plan, planner)

    if int(os.environ.get("RANK", "0")) == 1:
        SliceReader.read_data = read_data
    try:
        trainer("failed_read", qlora_model())
    finally:
        SliceReader.read_data = original
    return {"loaded": True}


SCENARIOS = {
    "failed_read": lambda: failed_read("model.embed_tokens.weight"),
    "failed_nf4_read": lambda: failed_read("model.layers.1.self_attn.k_proj.weight"),
    "sft": lambda: trl_run("sft"),
    "dpo": lambda: trl_run("dpo"),
    "merged": merged,
    "bnb_config": lambda: train("bnb_config"),
    "switch": lambda: train("switch", route="switch"),
    "sequence_parallel": lambda: train("sequence_parallel"),
    "resume": resume,
    "resume_elsewhere": resume_elsewhere,
    "checkpointing": lambda: train("checkpointing"),
    "compile": lambda: train("compile"),
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[4:], f"{RUN_DIR}.json")
