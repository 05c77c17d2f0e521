"""How each benchmarked system builds its trainer and consolidates its checkpoints. Everything else (data,
schedule, what is measured) is shared, so the systems differ only in what they are.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

# Every system's imports happen here, before the worker's after-imports memory baseline.
import torch
import torch.distributed as dist
import transformers.trainer as trainer_module
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, merge_fsdp_weights
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

import hf_fsdp2
from hf_fsdp2 import FSDP2Config, FSDP2Trainer, consolidate
from hf_fsdp2.adapters.nf4 import _torchao_nf4

try:
    _torchao_nf4()  # imported before the baseline like every other library (the 'qlora' extra)
except ImportError:
    pass

ADAPTERS = ("hf_fsdp2_lora", "hf_fsdp2_qlora")  # compared with each other, not with the full fine-tuning rows
# LoRA r=16 on every projection of the benchmark's Llama, for the adapter rows (LoRA and QLoRA).
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=16, lora_alpha=32, target_modules=PROJECTIONS)
NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def random_tokens(samples: int, seq_len: int, vocab: int) -> Any:
    """The same fixed token sequences for every system (labels = inputs: causal LM loss)."""
    ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def training_arguments(args: argparse.Namespace, resume: bool, **extra: Any) -> TrainingArguments:
    """One schedule for all: constant LR, no dropout randomness, a loss logged every step, saves at half and end."""
    cuda = torch.cuda.is_available()
    return TrainingArguments(
        output_dir=args.run_dir,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps + 1 if resume else args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no" if resume else "steps",
        save_steps=max(args.steps // 2, 1),
        report_to=[],
        disable_tqdm=True,
        use_cpu=not cuda,
        bf16=cuda,
        dataloader_drop_last=True,
        seed=0,
        **({"optim": args.optim} if getattr(args, "optim", None) else {}),
        **extra,
    )


def _hf_fsdp2(args: argparse.Namespace, data: Any, callbacks: list, resume: bool, async_save: bool) -> Trainer:
    """The product: FSDP2Trainer builds, loads and shards the model from its path."""
    config = FSDP2Config(async_save=async_save, consolidate_on_train_end=False)
    targs = training_arguments(args, resume)
    return FSDP2Trainer(args.model_path, targs, fsdp2_config=config, train_dataset=data, callbacks=callbacks)


def _hf_fsdp2_adapter(args: argparse.Namespace, data: Any, callbacks: list, resume: bool, qlora: bool) -> Trainer:
    """LoRA on the same model, its base in the checkpoint's dtype or (QLoRA) 4-bit NF4, as a user writes it."""
    base = hf_fsdp2.from_pretrained(args.model_path, quantization_config=NF4 if qlora else None)
    model = get_peft_model(base, LoraConfig(**LORA))
    config = FSDP2Config(consolidate_on_train_end=False)
    targs = training_arguments(args, resume)
    return FSDP2Trainer(model=model, args=targs, fsdp2_config=config, train_dataset=data, callbacks=callbacks)


def _transformers_fsdp2(args: argparse.Namespace, data: Any, callbacks: list, resume: bool) -> Trainer:
    """transformers' own FSDP2: from_pretrained shards at load time; Trainer leaves the model as it is.

    Trainer refuses optimizer checkpoints for such models ("Resuming is not supported for models sharded at
    load time"), so it saves the gathered model only (`save_only_model=True`) and cannot resume.
    """
    if resume:
        raise ValueError("transformers' native FSDP2 cannot resume: its Trainer checkpoints hold no optimizer state.")
    targs = training_arguments(args, resume, save_only_model=True)
    world = int(os.environ["WORLD_SIZE"])
    config = DistributedConfig(fsdp_size=world, fsdp_mixed_precision=targs.bf16)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, distributed_config=config)
    if not dist.is_initialized():
        raise RuntimeError("from_pretrained(distributed_config=...) did not start the process group.")
    return Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)


def _ddp(args: argparse.Namespace, data: Any, callbacks: list, resume: bool) -> Trainer:
    """The unsharded reference: every rank loads the whole model; Trainer wraps it in DDP."""
    targs = training_arguments(args, resume)
    model = AutoModelForCausalLM.from_pretrained(args.model_path)
    return Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)


class AccelerateFSDP2Trainer(Trainer):
    """`Trainer` + Accelerate's FSDP2 plugin, with FSDP2 forced where Accelerate would silently pick DDP.

    Accelerate turns FSDP on only for accelerator process groups (`AcceleratorState.__init__` lists
    MULTI_GPU, MULTI_NPU, ...); with CPU processes it keeps MULTI_CPU and Trainer trains with DDP. The
    plugin Trainer built from `fsdp_config` is installed on the state right after the Accelerator is
    created, exactly where Accelerate would have put it on a GPU machine.
    """

    def create_accelerator_and_postprocess(self) -> None:

        def accelerator_with_fsdp(**kwargs: Any) -> Accelerator:
            accelerator = Accelerator(**kwargs)
            state, plugin = accelerator.state, kwargs.get("fsdp_plugin")
            if plugin is not None and state.distributed_type == DistributedType.MULTI_CPU:
                FORCED.append("Accelerate chose DDP (MULTI_CPU) on this CPU machine; forced its FSDP2 plugin")
                state.distributed_type = DistributedType.FSDP
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                if state.mixed_precision != "no":
                    plugin.set_mixed_precision(state.mixed_precision)
                state.fsdp_plugin = plugin
            return accelerator

        trainer_module.Accelerator = accelerator_with_fsdp
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = Accelerator
        if not self.accelerator.is_fsdp2:
            raise RuntimeError(
                f"Accelerate is not running FSDP2 (distributed type {self.accelerator.distributed_type})."
            )


FORCED: list[str] = []


def _accelerate_fsdp2(args: argparse.Namespace, data: Any, callbacks: list, resume: bool) -> Trainer:
    """Trainer + Accelerate's FSDP2 plugin: sharded state dicts, RAM-efficient loading, one unit per block."""
    fsdp_config = {
        "version": 2,
        "state_dict_type": "SHARDED_STATE_DICT",
        "cpu_ram_efficient_loading": True,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True,
    }
    targs = training_arguments(args, resume, fsdp=True, fsdp_config=fsdp_config)
    # What `accelerate launch --use_fsdp` exports: with FSDP_CPU_RAM_EFFICIENT_LOADING (set by the arguments
    # above) it makes from_pretrained load the weights on rank 0 only; the plugin broadcasts them when sharding.
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    model = AutoModelForCausalLM.from_pretrained(args.model_path)
    return AccelerateFSDP2Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)


BUILDERS: dict[str, Callable[..., Trainer]] = {
    "hf_fsdp2": lambda *a, **k: _hf_fsdp2(*a, **k, async_save=False),
    "hf_fsdp2_async": lambda *a, **k: _hf_fsdp2(*a, **k, async_save=True),
    "accelerate_fsdp2": _accelerate_fsdp2,
    "transformers_fsdp2": _transformers_fsdp2,
    "ddp": _ddp,
    "hf_fsdp2_lora": lambda *a, **k: _hf_fsdp2_adapter(*a, **k, qlora=False),
    "hf_fsdp2_qlora": lambda *a, **k: _hf_fsdp2_adapter(*a, **k, qlora=True),
}


def build_trainer(system: str, args: argparse.Namespace, data: Any, callbacks: list, resume: bool) -> Trainer:
    """The trainer of `system`, ready for `train()`."""
    return BUILDERS[system](args, data, callbacks, resume=resume)


def consolidation_tool(system: str) -> Callable[[str, str], Any]:
    """The tool each system's users run to turn a sharded checkpoint into a Hugging Face folder."""
    if system == "hf_fsdp2":
        return consolidate
    if system == "accelerate_fsdp2":
        return lambda checkpoint, output: merge_fsdp_weights(os.path.join(checkpoint, "pytorch_model_fsdp_0"), output)
    raise ValueError(f"{system} writes full checkpoints: there is nothing to consolidate.")
