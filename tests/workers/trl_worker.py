"""TRL scenarios: plain SFTTrainer/DPOTrainer as one process, or hf_fsdp2's TRL trainers on any world size.

Usage: trl_worker.py {plain,fsdp2} OUT LLAMA [SCENARIO ...] [--reward-checkpoint PATH]; rank 0 writes
OUT/{MODE}-{WORLD}.json. Without scenarios: those of `SCENARIOS`; `BUILT_BY_TRL`'s are named.
fp32 throughout for parity (SFTConfig's bf16 default rounds differently under autocast and FSDP2's
mixed precision), except `sft_defaults`, which keeps SFTConfig's defaults and only has to train.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import (
    DPOConfig,
    DPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)

from tests.tiny_models import tiny_tokenizer
from tests.workers.scenarios import PARITY_ADAM_EPSILON, full_weights, losses, run_scenarios, saved_tensors

MODE, OUT, LLAMA = sys.argv[1:4]
CHOSEN = sys.argv[4:]
REWARD_CHECKPOINT = ""
if "--reward-checkpoint" in CHOSEN:
    at = CHOSEN.index("--reward-checkpoint")
    REWARD_CHECKPOINT = CHOSEN[at + 1]
    del CHOSEN[at : at + 2]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")
GLOBAL_BATCH = 4

if MODE == "fsdp2":
    from hf_fsdp2.trl import FSDP2DPOTrainer, FSDP2KTOTrainer, FSDP2RewardTrainer, FSDP2SFTTrainer

    SFT: type = FSDP2SFTTrainer
    DPO: type = FSDP2DPOTrainer
    KTO: type = FSDP2KTOTrainer
    REWARD: type = FSDP2RewardTrainer
else:
    SFT, DPO, KTO, REWARD = SFTTrainer, DPOTrainer, KTOTrainer, RewardTrainer


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(3, 96, (n,), generator=g))


def sft_data(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(0)
    return Dataset.from_dict({"prompt": [words(g, 4) for _ in range(n)], "completion": [words(g, 6) for _ in range(n)]})


def dpo_data(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(1)
    rows = [(words(g, 4), words(g, 5), words(g, 5)) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})


def common(name: str) -> dict[str, Any]:
    return dict(
        output_dir=os.path.join(RUN_DIR, name),
        per_device_train_batch_size=GLOBAL_BATCH // WORLD,
        max_steps=4,
        learning_rate=1e-3,
        adam_epsilon=PARITY_ADAM_EPSILON,  # compared element-wise across world sizes: see its definition
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=11,
    )


def sft_config(name: str, **overrides: Any) -> SFTConfig:
    return SFTConfig(**{**common(name), "bf16": False, "gradient_checkpointing": False, "max_length": 32, **overrides})


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def sft_full() -> dict[str, Any]:
    """Full fine-tune from a model path."""
    trainer = SFT(LLAMA, args=sft_config("sft_full"), train_dataset=sft_data(), processing_class=tiny_tokenizer())
    trainer.train()
    return {"losses": losses(trainer), "weights": full_weights(trainer.model)}


def sft_lora() -> dict[str, Any]:
    """SFTTrainer's own peft_config: adapters built on the skeleton; adapter-only checkpoint, then resume."""
    name = "sft_lora"
    config = sft_config(name, save_strategy="steps", save_steps=2)
    trainer = SFT(LLAMA, args=config, train_dataset=sft_data(), processing_class=tiny_tokenizer(), peft_config=lora())
    trainer.train()
    adapters = full_weights(trainer.model, trainable_only=True)
    checkpoint = os.path.join(config.output_dir, "checkpoint-2")
    resumed = SFT(LLAMA, args=config, train_dataset=sft_data(), processing_class=tiny_tokenizer(), peft_config=lora())
    resumed.train(resume_from_checkpoint=checkpoint)
    export = os.path.join(RUN_DIR, "sft_lora_export")
    resumed.save_model(export)
    result = {
        "losses": losses(trainer),
        "resumed": losses(resumed)[2:],
        "adapters": adapters,
        "checkpoint_files": sorted(f for f in os.listdir(checkpoint) if not f.startswith("rng_state")),
        "exported": saved_tensors(export) if RANK == 0 else {},
    }
    if MODE == "fsdp2":
        resumed.fsdp2_config.merge_adapters_on_save = True
        merged = os.path.join(RUN_DIR, "sft_lora_merged")
        resumed.save_model(merged)
        result["fsdp2_only"] = {"merged_vs_peft": merged_difference(export, merged) if RANK == 0 else 0.0}
    return result


def merged_difference(adapter: str, merged: str) -> float:
    """Largest difference between our merged export and peft's merge_and_unload of the adapter export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    return max(float((ours[k] - theirs[k]).abs().max()) for k in ours)


def sft_lora_object() -> dict[str, Any]:
    """A model object (weights on every rank) with peft_config, through `class X(FSDP2Trainer, SFTTrainer)`."""
    from transformers import AutoModelForCausalLM

    trainer_class = SFT
    if MODE == "fsdp2":
        from hf_fsdp2 import FSDP2Trainer

        class Combined(FSDP2Trainer, SFTTrainer):  # the order users wrote before FSDP2Mixin existed
            pass

        trainer_class = Combined
    model = AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.float32)
    config = sft_config("sft_lora_object")
    trainer = trainer_class(
        model, args=config, train_dataset=sft_data(), processing_class=tiny_tokenizer(), peft_config=lora()
    )
    trainer.train()
    return {"losses": losses(trainer), "adapters": full_weights(trainer.model, trainable_only=True)}


def sft_defaults() -> dict[str, Any]:
    """SFTConfig's own defaults (bf16=True, gradient_checkpointing=True): it must train (no parity in bf16)."""
    config = SFTConfig(**{**common("sft_defaults"), "max_length": 32, "learning_rate": 1e-2})
    assert config.bf16 and config.gradient_checkpointing, "SFTConfig's defaults changed; update the scenario"
    trainer = SFT(LLAMA, args=config, train_dataset=sft_data(), processing_class=tiny_tokenizer(), peft_config=lora())
    trainer.train()
    return {"bf16_losses": losses(trainer)}


def dpo_config(name: str) -> DPOConfig:
    return DPOConfig(**{**common(name), "bf16": False, "gradient_checkpointing": False, "max_length": 32})


def dpo_full() -> dict[str, Any]:
    """Full DPO: the reference is a second copy of the model, sharded and frozen."""
    trainer = DPO(LLAMA, args=dpo_config("dpo_full"), train_dataset=dpo_data(), processing_class=tiny_tokenizer())
    trainer.train()
    result = {"losses": losses(trainer), "weights": full_weights(trainer.model)}
    if MODE == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        ref = trainer.ref_model
        result["fsdp2_only"] = {
            "ref_sharded": isinstance(ref, FSDPModule),
            "ref_trainable": sum(p.requires_grad for p in ref.parameters()),
            "optimizer_params": sum(len(g["params"]) for g in trainer.optimizer.param_groups),
            "policy_params": len(list(trainer.model.parameters())),
        }
    return result


def dpo_lora() -> dict[str, Any]:
    """DPO with peft_config: the adapter-disabled policy serves as the reference."""
    trainer = DPO(
        LLAMA,
        args=dpo_config("dpo_lora"),
        train_dataset=dpo_data(),
        processing_class=tiny_tokenizer(),
        peft_config=lora(),
    )
    trainer.train()
    return {"losses": losses(trainer), "adapters": full_weights(trainer.model, trainable_only=True)}


def precomputed(name: str, ref_model: Any = None, trainer_class: type | None = None, **data: Any) -> dict[str, Any]:
    """DPO (or KTO) with precompute_ref_log_probs=True: TRL names the cache from the hash of the weights it scores
    with (the reference given, else the policy's), then reads the reference log-probs from the dataset."""
    if trainer_class is None:
        trainer_class, config_class, dataset = DPO, DPOConfig, dpo_data()
    else:
        config_class, dataset = KTOConfig, kto_data()
    config = config_class(
        **{**common(name), "bf16": False, "gradient_checkpointing": False, "max_length": 32},
        precompute_ref_log_probs=True,
    )
    dataset = data.get("dataset") or on_disk(dataset, os.path.join(OUT, f"{name}-{WORLD}-data"))
    trainer = trainer_class(LLAMA, ref_model, args=config, train_dataset=dataset, processing_class=tiny_tokenizer())
    columns = [c for c in trainer.train_dataset.column_names if c.startswith("ref_") or c == "reference_logps"]
    reference = {c: list(trainer.train_dataset[c]) for c in columns}
    # TRL's own tests copy the parameters right after construction, to compare them after training.
    kinds = sorted({type(p).__name__ for p in trainer.model.parameters()})
    trainer.train()
    result = {
        "cache_hash": trainer._precompute_model_hash,
        "reference_logps": reference,
        "losses": losses(trainer),
        "weights": full_weights(trainer.model),
    }
    if MODE == "fsdp2":
        result["fsdp2_only"] = {"parameter_types_after_init": kinds}
    return result


def on_disk(dataset: Dataset, directory: str) -> Dataset:
    """The dataset saved by rank 0 and read back by every rank: TRL writes the cache beside the dataset's files, and
    an in-memory dataset's are in each process's own temporary folder, where the other ranks cannot find them."""
    import torch.distributed as dist
    from datasets import load_from_disk

    if WORLD > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if RANK == 0:
        dataset.save_to_disk(directory)
    if WORLD > 1:
        dist.barrier()
    return load_from_disk(directory)


def perturbed_reference() -> Any:
    """A separate reference model: the tiny Llama with its final norm scaled, so its log-probs differ."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(LLAMA)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    return model


def dpo_precompute() -> dict[str, Any]:
    """No reference model: TRL hashes the policy's weights, precomputes with the policy before training."""
    return precomputed("dpo_precompute")


def dpo_precompute_ref() -> dict[str, Any]:
    """A separate reference model, hashed before it is sharded."""
    return precomputed("dpo_precompute_ref", perturbed_reference())


def dpo_precompute_iterable() -> dict[str, Any]:
    """TRL refuses an IterableDataset with precompute: its own message must reach the user."""
    try:
        precomputed("dpo_precompute_iterable", dataset=dpo_data().to_iterable_dataset())
    except ValueError as error:
        return {"error_message": str(error)}
    return {"error_message": None}


def preference_data(n: int = 32) -> Dataset:
    """Implicit-prompt preference pairs, as RewardTrainer takes them."""
    g = torch.Generator().manual_seed(2)
    rows = [(words(g, 6), words(g, 6)) for _ in range(n)]
    return Dataset.from_dict({"chosen": [r[0] for r in rows], "rejected": [r[1] for r in rows]})


def reward(name: str, path: str) -> dict[str, Any]:
    """RewardTrainer given a path: TRL builds its num_labels=1 classifier (its head new or from the checkpoint)."""
    config = RewardConfig(**{**common(name), "bf16": False, "gradient_checkpointing": False, "max_length": 32})
    trainer = REWARD(path, args=config, train_dataset=preference_data(), processing_class=tiny_tokenizer())
    trainer.train()
    result = {"losses": losses(trainer), "weights": full_weights(trainer.model)}
    result["model"] = {
        "class": type(trainer.model).__name__.removeprefix("FSDP"),
        "num_labels": trainer.model.num_labels,
    }
    if MODE == "fsdp2":
        from hf_fsdp2.loading.skeleton import get_source

        result["fsdp2_only"] = {"read_by_slices": get_source(trainer.model) is not None}
    return result


def reward_causal_path() -> dict[str, Any]:
    """TRL's documented usage: a causal LM's path; the score head is initialized after TRL's set_seed."""
    return reward("reward_causal_path", LLAMA)


def reward_seqcls_path() -> dict[str, Any]:
    """A sequence-classification checkpoint's path: its trained score head is read, not made anew."""
    return reward("reward_seqcls_path", REWARD_CHECKPOINT)


def kto_data(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(3)
    rows = [(words(g, 4), words(g, 5), bool(i % 3)) for i in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "completion", "label"))})


def kto_full() -> dict[str, Any]:
    """Full KTO from a path; the reference model TRL builds from the same path is sharded frozen."""
    config = KTOConfig(**{**common("kto_full"), "bf16": False, "gradient_checkpointing": False, "max_length": 32})
    trainer = KTO(LLAMA, args=config, train_dataset=kto_data(), processing_class=tiny_tokenizer())
    trainer.train()
    result = {"losses": losses(trainer), "weights": full_weights(trainer.model)}
    if MODE == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        from hf_fsdp2.loading.skeleton import get_source

        ref = trainer.ref_model
        result["fsdp2_only"] = {
            "ref_sharded": isinstance(ref, FSDPModule),
            "ref_trainable": sum(p.requires_grad for p in ref.parameters()),
            "read_by_slices": get_source(trainer.model) is not None and get_source(ref) is not None,
        }
    return result


def kto_precompute() -> dict[str, Any]:
    """KTO with precompute_ref_log_probs=True and no reference model (TRL then keeps none)."""
    return precomputed("kto_precompute", trainer_class=KTO)


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (sft_full, sft_lora, sft_lora_object, sft_defaults, dpo_full, dpo_lora)
}
# Trainers that build their model from a path themselves (tests/test_trl_built_models.py names them).
BUILT_BY_TRL: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (reward_causal_path, reward_seqcls_path, kto_full, kto_precompute)
}
# Precomputed reference log-probs (tests/test_trl_built_models.py names them too).
PRECOMPUTE: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (dpo_precompute, dpo_precompute_ref, dpo_precompute_iterable)
}

if __name__ == "__main__":
    run_scenarios({**SCENARIOS, **BUILT_BY_TRL, **PRECOMPUTE}, CHOSEN or list(SCENARIOS), f"{RUN_DIR}.json")
