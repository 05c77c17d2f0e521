"""The jobs of part "two_ranks", written once for any world size: the same job runs at 2 ranks and in one process,
and only the world size differs. The tiny models, the data and the arguments they share are here too.

Same rows, same sums, by construction: a rank's batch is PER_RANK rows, and one process takes the two ranks' batches
of a step as two micro-batches (gradient accumulation), in the same order (rank r's batch is micro-batch r+1). So each
micro-batch runs the same kernels on the same shapes in both runs, and the gradients meet in one sum of the same two
terms (FSDP2's reduce-scatter at 2 ranks, accumulation in one process; a sum of two is the same in either order).
What is left to rounding are sums over shards: the grad norm's, Adafactor's statistics, sequence-parallel slices.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from gpu_parts.common import on_cuda

PER_RANK = 2  # rows per rank and step; one process takes 2 micro-batches of this size
STEPS = 4
# Adam's epsilon in every compared run: at the default 1e-8 a gradient that is rounding noise steps by about the
# learning rate in a direction set by summation order; tests/workers/scenarios.py (PARITY_ADAM_EPSILON) measures why.
ADAM_EPSILON = 1e-3
VOCAB = 96  # the word-level tokenizer's: <pad>, <s>, </s>, t3..t95
# Every projection splits into whole NF4 blocks (64 x 256 values) at 2 ranks, so QLoRA quantizes all 14 of them.
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def root() -> str:
    return os.path.join(os.environ["GPU_CHECK_WORKDIR"], "two_ranks")


def model_path(name: str) -> str:
    return os.path.join(root(), name)


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def build_models() -> None:
    """Save the tiny Llama and its reward model (num_labels=1), each with the tokenizer; seeded, once per workdir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    for name, make in (("llama", LlamaForCausalLM), ("reward", LlamaForSequenceClassification)):
        if os.path.exists(os.path.join(model_path(name), "config.json")):
            continue
        torch.manual_seed(0)
        make(LlamaConfig(**SHAPE, num_labels=1)).save_pretrained(model_path(name))
        tokenizer().save_pretrained(model_path(name))


def tokenizer() -> Any:
    """A word-level fast tokenizer over the tiny vocabulary ('t3'..'t95'), built here: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def fresh_dir(name: str) -> str:
    """This world size's run folder of a job, emptied by rank 0 (NOTE: collective at 2 ranks: every rank waits)."""
    import torch.distributed as dist

    from hf_fsdp2.distributed import init_distributed

    init_distributed()
    path = os.path.join(root(), "runs", f"{name.replace(' ', '_')}-{world()}")
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    if world() > 1:
        dist.barrier()
    return path


def padded_rows(n: int = 32, seq: int = 16) -> Any:
    """Rows of 8-16 tokens padded to 16, padding labelled -100: the token count differs per batch, so the loss's
    normalization by the global count is exercised."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        length = int(torch.randint(seq // 2, seq + 1, (1,), generator=generator))
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        rows["input_ids"].append(ids + [0] * (seq - length))
        rows["attention_mask"].append([1] * length + [0] * (seq - length))
        rows["labels"].append(ids + [-100] * (seq - length))
    return Dataset.from_dict(rows)


def documents(n: int = 32) -> Any:
    """Documents of 5-40 tokens to pack, a prompt of 4 tokens masked in every third (sequence parallelism's data)."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    rows: dict[str, list] = {"input_ids": [], "labels": []}
    for index in range(n):
        length = int(torch.randint(5, 41, (1,), generator=generator))
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        prompt = 4 if index % 3 == 0 else 0
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return Dataset.from_dict(rows)


def arguments(out: str, config_class: Any = None, **overrides: Any) -> Any:
    """The schedule of every compared job: PER_RANK rows per rank, the other rank's as a second micro-batch in one
    process, constant learning rate, a loss every step, fp32 unless asked."""
    from transformers import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=PER_RANK, gradient_accumulation_steps=2 // world(),
        max_steps=STEPS, learning_rate=1e-3, adam_epsilon=ADAM_EPSILON, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=not on_cuda(), seed=0,
        dataloader_drop_last=True, bf16=False,
    )  # fmt: skip
    values.update(overrides)
    return (config_class or TrainingArguments)(**values)


def fsdp2_config(**overrides: Any) -> Any:
    from hf_fsdp2 import FSDP2Config

    return FSDP2Config(**{"consolidate_on_train_end": False, "checkpoint_on_signals": [], **overrides})


def outcome(trainer: Any, name: str) -> dict:
    """A trained job's losses and grad norms, its trained weights gathered into a file (NOTE: collective)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    history = [h for h in trainer.state.log_history if "loss" in h]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(trainer.model, options=options)  # full tensors on rank 0 only
    path = os.path.join(root(), "weights", f"{name.replace(' ', '_')}-{world()}.pt")
    if rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({k: v.float() for k, v in weights.items()}, path)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    parameters = trainer.model.parameters()
    return {
        "compared": {"losses": [h["loss"] for h in history]},
        "grad_norms": [h.get("grad_norm") for h in history],
        "weight_files": {"final": path},
        "optimizer": type(optimizer).__name__,
        "nf4_weights": sum(type(getattr(p, "_local_tensor", p)).__name__ == "NF4Tensor" for p in parameters),
    }


def trained(name: str, model: Any = None, config: dict | None = None, **kwargs: Any) -> dict:
    """Train the job's FSDP2Trainer (the tiny Llama's path unless a model is given) for STEPS steps."""
    from hf_fsdp2 import FSDP2Trainer

    args = arguments(fresh_dir(name), **kwargs.pop("args", {}))
    data = kwargs.pop("train_dataset", None) or padded_rows()
    trainer = FSDP2Trainer(
        model or model_path("llama"), args, fsdp2_config=fsdp2_config(**(config or {})), train_dataset=data, **kwargs
    )
    trainer.train()
    return outcome(trainer, name)


def adapted(quantized: bool) -> Any:
    """LoRA (r=4, every projection) over the base built by hf_fsdp2.from_pretrained, NF4 when `quantized`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    import hf_fsdp2

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if quantized else None
    base = hf_fsdp2.from_pretrained(model_path("llama"), quantization_config=nf4)
    torch.manual_seed(0)  # LoRA's initial values, the same in every run
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


def lora(name: str) -> dict:
    """LoRA on every projection of the fp32 base: the adapters' losses and weights."""
    return trained(name, adapted(quantized=False), args=dict(learning_rate=1e-2))


def qlora(name: str) -> dict:
    """QLoRA: a 4-bit NF4 base (each rank quantizes its own rows) under LoRA; every projection must be NF4."""
    record = trained(name, adapted(quantized=True), args=dict(learning_rate=1e-2))
    record["checks"] = {"all 14 projections NF4": record["nf4_weights"] == 14}
    return record


def offload(name: str) -> dict:
    """cpu_offload=True with max_grad_norm=0.01, so every step clips (coefficient < 1) through the offloaded norm."""
    try:
        record = trained(name, config=dict(cpu_offload=True), args=dict(max_grad_norm=0.01))
    except ValueError as error:
        if "cpu_offload=True moves shards from an accelerator" in str(error) and not on_cuda():
            return {"status": "skipped: no accelerator", "refused": str(error)[:300]}
        raise
    norms = record["grad_norms"]
    record["checks"] = {"clipped every step (grad norm > 0.01)": bool(norms) and all(n > 0.01 for n in norms)}
    return record


def sequence_parallel(name: str) -> dict:
    """Packed documents (position ids restart per document): sequence_parallel_size=2 at 2 ranks, 1 in one process."""
    from transformers import DataCollatorWithFlattening

    packed = dict(train_dataset=documents(), data_collator=DataCollatorWithFlattening())
    config = dict(sequence_parallel_size=world())
    return trained(name, config=config, args=dict(remove_unused_columns=False), **packed)


def save_resume_consolidate(name: str) -> dict:
    """4 steps saving at 2; a fresh trainer resumed from checkpoint-2 to step 4, consolidating at its end into a folder
    that AutoModelForCausalLM.from_pretrained loads. One process: 4 steps in one go."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_fsdp2 import FSDP2Trainer

    if world() == 1:
        return trained(name)
    out = fresh_dir(name)
    first = FSDP2Trainer(
        model_path("llama"), arguments(os.path.join(out, "first"), save_strategy="steps", save_steps=2),
        fsdp2_config=fsdp2_config(), train_dataset=padded_rows(),
    )  # fmt: skip
    first.train()
    resumed = FSDP2Trainer(
        model_path("llama"), arguments(os.path.join(out, "resumed")),
        fsdp2_config=fsdp2_config(consolidate_on_train_end=True), train_dataset=padded_rows(),
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=os.path.join(out, "first", "checkpoint-2"))
    record = {"compared": {"losses": [h["loss"] for h in resumed.state.log_history if "loss" in h]}}
    path = os.path.join(out, "exported.pt")
    if rank() == 0:
        state = AutoModelForCausalLM.from_pretrained(os.path.join(out, "resumed"), dtype=torch.float32).state_dict()
        torch.save({k: v.float() for k, v in state.items()}, path)
    return record | {"weight_files": {"from_pretrained of the export": path}}


def offload_control(name: str) -> dict:
    """What hf_fsdp2's meshes prevent: torch's plain mesh over the default group (NCCL's device rules) with CPU
    offload; the grad norm's reduction hands that group a CPU tensor and must fail."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not on_cuda():
        return {"status": "skipped: no accelerator"}  # no CUDA mesh to build, and gloo on the CPU takes CPU tensors
    mesh = init_device_mesh("cuda", (world(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    model(torch.randn(4, 64, device="cuda")).square().mean().backward()
    try:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()
    except RuntimeError as error:
        if "No backend type associated with device type cpu" not in str(error):
            raise
        return {"status": "control failed as expected", "control_error": str(error)[:500]}
    why = "the default group took a CPU tensor, as NCCL would not: the cpu offload job's pass shows nothing"
    return {"status": "control unexpectedly passed", "error": why, "norm": float(norm)}


def muon(name: str) -> dict:
    """hf_fsdp2.Muon (Newton-Schulz in fp32: in bf16, gradients one bit apart round apart) with AdamW beside it."""
    import hf_fsdp2

    keywords = {"lr": 0.02, "adjust_lr_fn": None, "ns_dtype": "float32"}
    record = trained(name, optimizer_cls_and_kwargs=(hf_fsdp2.Muon, keywords))
    record["checks"] = {"optimizer is MuonAdamW": record["optimizer"] == "MuonAdamW"}
    return record


def adafactor(name: str) -> dict:
    """TrainingArguments(optim="adafactor"): its row and column statistics summed over the shard group."""
    record = trained(name, args=dict(optim="adafactor"))
    record["checks"] = {"optimizer is ShardedAdafactor": record["optimizer"] == "ShardedAdafactor"}
    return record
