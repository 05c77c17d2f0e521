"""Ordinary Trainer scripts with the class swapped: each scenario runs with plain `Trainer` or `FSDP2Trainer`.

Usage: dropin_worker.py {plain,fsdp2} OUT LLAMA GPT2 [SCENARIO ...]. All scenarios run in one launch (one
process group); rank 0 writes OUT/results.json: scenario -> numbers (losses, weights, files) or an error.
Like a user's script, this worker never calls close_distributed(): the process group ends by itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    EarlyStoppingCallback,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)

from tests.workers.scenarios import (
    full_weights,
    losses,
    parity_arguments,
    run_scenarios,
    saved_configs,
    saved_tensors,
)
from tests.workers.train_worker import make_dataset

MODE, OUT, LLAMA, GPT2 = sys.argv[1:5]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
GLOBAL_BATCH = 4
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")

if MODE == "fsdp2":
    from hf_fsdp2 import FSDP2Mixin, FSDP2Trainer

    TrainerClass: type[Trainer] = FSDP2Trainer
    Mixins: tuple[type, ...] = (FSDP2Mixin,)
else:
    TrainerClass = Trainer
    Mixins = ()


class Regressor(nn.Module):
    """A plain nn.Module: no _no_split_modules, a 0-dim scale parameter, a dict output with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.body(x).squeeze(-1) * self.scale
        loss = nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


class TinyConfig(PretrainedConfig):
    model_type = "hf_fsdp2_tiny_mlp"

    def __init__(self, width: int = 8, depth: int = 3, **kwargs: Any) -> None:
        self.width, self.depth = width, depth
        super().__init__(**kwargs)


class TinyMLP(PreTrainedModel):
    """A custom PreTrainedModel that declares no _no_split_modules, with a scalar temperature."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(nn.Linear(config.width, config.width) for _ in range(config.depth))
        self.head = nn.Linear(config.width, 1)
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.post_init()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.relu(layer(x))
        out = self.head(x).squeeze(-1) / self.temperature
        loss = nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


def regression_data(n: int, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return Dataset.from_dict({"x": x.tolist(), "labels": (x.sum(-1) * 0.3).tolist()})


def args(name: str, **overrides: Any) -> TrainingArguments:
    """Arguments a user would write; the per-device batch keeps the global batch equal at any world size."""
    return parity_arguments(os.path.join(RUN_DIR, name), GLOBAL_BATCH // WORLD, **overrides)


def causal_model() -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(LLAMA)


# ---- scenarios -----------------------------------------------------------------------------------------


def plain_module() -> dict[str, Any]:
    """A plain nn.Module with a scalar parameter: train, evaluate, save_model."""
    torch.manual_seed(0)
    model = Regressor()
    trainer = TrainerClass(
        model, args("plain_module"), train_dataset=regression_data(32), eval_dataset=regression_data(8, 1)
    )
    trainer.train()
    evaluation = trainer.evaluate()
    export = os.path.join(RUN_DIR, "plain_module_export")
    trainer.save_model(export)
    return {
        "losses": losses(trainer),
        "eval_loss": evaluation["eval_loss"],
        "weights": full_weights(trainer.model),
        "exported": saved_tensors(export) if RANK == 0 else {},
    }


def scalar_resume() -> dict[str, Any]:
    """Checkpoints of a model with a scalar: a fresh model and trainer resume from checkpoint-2 exactly."""
    name = "scalar_resume"
    torch.manual_seed(0)
    first = TrainerClass(
        Regressor(), args(name, save_strategy="steps", save_steps=2), train_dataset=regression_data(32)
    )
    first.train()
    torch.manual_seed(1)  # the resumed model starts from other weights: all of them must come from the checkpoint
    second = TrainerClass(Regressor(), args(name, save_strategy="no"), train_dataset=regression_data(32))
    second.train(resume_from_checkpoint=os.path.join(RUN_DIR, name, "checkpoint-2"))
    return {"losses": losses(first), "resumed": losses(second), "weights": full_weights(second.model)}


def custom_pretrained() -> dict[str, Any]:
    """A custom PreTrainedModel without _no_split_modules: train, then from_pretrained of the export."""
    torch.manual_seed(0)
    model = TinyMLP(TinyConfig())
    trainer = TrainerClass(model, args("custom_pretrained"), train_dataset=regression_data(32))
    trainer.train()
    export = os.path.join(RUN_DIR, "custom_pretrained_export")
    trainer.save_model(export)
    weights = full_weights(trainer.model)
    reloaded = TinyMLP.from_pretrained(export)
    probe = regression_data(4, 3)["x"]
    with torch.no_grad():
        logits = reloaded(torch.tensor(probe))["logits"].tolist()
    return {
        "losses": losses(trainer),
        "weights": weights,
        "reloaded_logits": logits,
        "configs": saved_configs(export) if RANK == 0 else {},
    }


def second_trainer() -> dict[str, Any]:
    """Two trainers on one GPT-2 object (a notebook's second run), then a third that only evaluates."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(GPT2)
    data, held_out = make_dataset(32, 96), make_dataset(8, 96, seed=1)
    first = TrainerClass(model, args("second_trainer", max_steps=2, learning_rate=1e-3), train_dataset=data)
    first.train()
    second = TrainerClass(model, args("second_trainer", max_steps=2, seed=8, learning_rate=1e-3), train_dataset=data)
    second.train()
    third = TrainerClass(model, args("second_trainer"), eval_dataset=held_out)
    return {
        "losses": losses(first) + losses(second),
        "eval_loss": third.evaluate()["eval_loss"],
        "weights": full_weights(model),
    }


def model_init() -> dict[str, Any]:
    """`model_init` instead of `model`: a fresh model per train() call, seeded by Trainer."""
    trainer = TrainerClass(
        model_init=lambda: AutoModelForCausalLM.from_pretrained(LLAMA),
        args=args("model_init", max_steps=3),
        train_dataset=make_dataset(32, 96),
    )
    trainer.train()
    first = losses(trainer)
    trainer.train()  # a second call builds the model again
    return {"losses": first, "again": losses(trainer), "weights": full_weights(trainer.model)}


def best_model_and_early_stopping() -> dict[str, Any]:
    """load_best_model_at_end with save_total_limit, eval_on_start and early stopping."""
    name = "best_model"
    training = args(
        name,
        max_steps=12,
        learning_rate=0.05,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        eval_on_start=True,
    )
    trainer = TrainerClass(
        causal_model(),
        training,
        train_dataset=make_dataset(48, 96),
        eval_dataset=make_dataset(8, 96, seed=1),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    checkpoints = sorted(d for d in os.listdir(training.output_dir) if d.startswith("checkpoint-"))
    return {
        "losses": losses(trainer),
        "evals": evals,
        "global_step": trainer.state.global_step,
        "best": os.path.basename(trainer.state.best_model_checkpoint or ""),
        "checkpoints": checkpoints,
        "eval_after_best": trainer.evaluate()["eval_loss"],
        "configs": {c: saved_configs(os.path.join(training.output_dir, c)) for c in checkpoints} if RANK == 0 else {},
    }


def predict() -> dict[str, Any]:
    """predict() and prediction_loss_only after training: the gathered logits and labels."""
    trainer = TrainerClass(causal_model(), args("predict", max_steps=2), train_dataset=make_dataset(32, 96))
    trainer.train()
    output = trainer.predict(make_dataset(8, 96, seed=1))
    trainer.args.prediction_loss_only = True
    only_loss = trainer.evaluate(make_dataset(8, 96, seed=1))
    return {
        "test_loss": output.metrics["test_loss"],
        "predictions": torch.as_tensor(output.predictions).flatten()[::7].tolist(),
        "label_shape": list(output.label_ids.shape),
        "loss_only": only_loss["eval_loss"],
    }


def custom_optimizer() -> dict[str, Any]:
    """optimizers=(SGD with momentum, LambdaLR) built by the user over the unsharded model."""
    model = causal_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    trainer = TrainerClass(
        model, args("custom_optimizer"), train_dataset=make_dataset(32, 96), optimizers=(optimizer, scheduler)
    )
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    return {"losses": losses(trainer), "lrs": lrs, "weights": full_weights(trainer.model)}


def iterable_dataset() -> dict[str, Any]:
    """An IterableDataset with max_steps."""
    data = make_dataset(32, 96).to_iterable_dataset()
    trainer = TrainerClass(causal_model(), args("iterable"), train_dataset=data)
    trainer.train()
    return {"losses": losses(trainer), "weights": full_weights(trainer.model)}


def gradient_checkpointing() -> dict[str, Any]:
    """gradient_checkpointing=True in TrainingArguments."""
    training = args("gradient_checkpointing", gradient_checkpointing=True)
    trainer = TrainerClass(causal_model(), training, train_dataset=make_dataset(32, 96))
    trainer.train()
    return {"losses": losses(trainer), "weights": full_weights(trainer.model)}


def subclass() -> dict[str, Any]:
    """A user's Trainer subclass with its own compute_loss (FSDP2Mixin first in the bases)."""

    class L2Trainer(*Mixins, Trainer):  # type: ignore[misc]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            logits = outputs["logits"]
            loss = loss + 0.01 * logits.float().pow(2).mean()
            return (loss, outputs) if return_outputs else loss

    trainer = L2Trainer(causal_model(), args("subclass"), train_dataset=make_dataset(32, 96))
    trainer.train()
    return {"losses": losses(trainer), "weights": full_weights(trainer.model)}


def seq2seq_own_loss() -> dict[str, Any]:
    """T5: its forward takes **kwargs but computes its own mean loss, so the loss must not be scaled by ranks."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=50,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(
        {
            "input_ids": torch.randint(1, 50, (16, 6), generator=g).tolist(),
            "labels": torch.randint(1, 50, (16, 4), generator=g).tolist(),
        }
    )
    trainer = TrainerClass(model, args("seq2seq", learning_rate=1e-3), train_dataset=data)
    trainer.train()
    export = os.path.join(RUN_DIR, "seq2seq_export")
    trainer.save_model(export)
    return {
        "losses": losses(trainer),
        "weights": full_weights(trainer.model),
        "configs": saved_configs(export) if RANK == 0 else {},
    }


class ClipWithLoss(nn.Module):
    """CLIP returning its contrastive loss (which depends on the per-rank batch, like DDP's)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import CLIPConfig, CLIPModel

        text = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
        vision = dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        )
        self.clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> Any:
        return self.clip(input_ids=input_ids, pixel_values=pixel_values, return_loss=True)


def clip() -> dict[str, Any]:
    """CLIP's 0-dim logit_scale trains; on every rank it holds the same value."""
    import torch.distributed as dist

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(
        {
            "input_ids": torch.randint(0, 50, (16, 6), generator=g).tolist(),
            "pixel_values": torch.randn(16, 3, 8, 8, generator=g).tolist(),
        }
    )
    trainer = TrainerClass(ClipWithLoss(), args("clip", learning_rate=1e-3), train_dataset=data)
    trainer.train()
    scale = float(trainer.model.clip.logit_scale.detach())
    every_rank = [scale] * WORLD
    if dist.is_initialized() and WORLD > 1:
        dist.all_gather_object(every_rank, scale)
    return {"losses": losses(trainer), "weights": full_weights(trainer.model), "per_rank": {"logit_scale": every_rank}}


def hyperparameter_search() -> dict[str, Any]:
    """Trainer.hyperparameter_search with optuna (seeded sampler): every trial's model comes from model_init."""
    import optuna

    trainer = TrainerClass(
        model_init=lambda trial=None: AutoModelForCausalLM.from_pretrained(LLAMA),
        args=args("hp_search", max_steps=2),
        train_dataset=make_dataset(16, 96),
        eval_dataset=make_dataset(8, 96, seed=1),
    )
    best = trainer.hyperparameter_search(
        direction="minimize",
        backend="optuna",
        n_trials=2,
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)},
        sampler=optuna.samplers.TPESampler(seed=0),
    )
    # Trainer runs the study on rank 0 only; the other ranks follow its trials.
    return {"objective": best.objective, "learning_rate": best.hyperparameters["learning_rate"]} if RANK == 0 else {}


def torch_compile() -> dict[str, Any]:
    """torch_compile=True in TrainingArguments.

    With the aot_eager backend: Trainer's compile path through dynamo and AOTAutograd, where FSDP2's hooks and
    DTensors meet the compiler, without inductor's C++ code generation, which cost ~28 s per process on an empty
    kernel cache here (a clean CI machine has one). Inductor with FSDP2 is test_parity's GENERATE_WITH run.
    """
    training = args("torch_compile", max_steps=2, torch_compile=True, torch_compile_backend="aot_eager")
    trainer = TrainerClass(causal_model(), training, train_dataset=make_dataset(32, 96))
    trainer.train()
    return {"losses": losses(trainer)}


def refusals() -> dict[str, Any]:
    """What a user gets for a model sharded another way (FSDP2Trainer only)."""
    from torch.distributed.fsdp import fully_shard

    from hf_fsdp2 import FSDP2Config

    messages = {}
    model = causal_model()
    TrainerClass(model, args("refusals"), train_dataset=make_dataset(8, 96))
    for key, attempt in {
        "bf16_now": lambda: TrainerClass(model, args("refusals", bf16=True)),
        "other_units": lambda: TrainerClass(
            model, args("refusals"), fsdp2_config=FSDP2Config(reshard_after_forward=False)
        ),
        "foreign": lambda: TrainerClass(fully_shard(causal_model()), args("refusals")),
        "unknown_block": lambda: TrainerClass(
            causal_model(), args("refusals"), fsdp2_config=FSDP2Config(transformer_layer_cls_to_wrap=["NoSuchBlock"])
        ),
    }.items():
        try:
            attempt()
            messages[key] = "accepted"
        except ValueError as error:
            messages[key] = str(error)
    return messages


def _by_path(name: str) -> Any:
    """A saved tiny model beside LLAMA: FSDP2Trainer takes its path (each rank reads its slices)."""
    path = os.path.join(os.path.dirname(LLAMA), name)
    return path if MODE == "fsdp2" else AutoModelForCausalLM.from_pretrained(path)


def moe_qwen3() -> dict[str, Any]:
    """Qwen3-MoE by path: fused experts, the router's auxiliary loss in the loss (output_router_logits=True)."""
    trainer = TrainerClass(_by_path("qwen3_moe"), args("moe_qwen3"), train_dataset=make_dataset(32, 96))
    trainer.train()
    return {"losses": losses(trainer), "grad_norms": grad_norms(trainer), "weights": full_weights(trainer.model)}


def moe_mixtral() -> dict[str, Any]:
    """Mixtral by path: the same, with its own router and expert layout."""
    trainer = TrainerClass(_by_path("mixtral"), args("moe_mixtral"), train_dataset=make_dataset(32, 96))
    trainer.train()
    return {"losses": losses(trainer), "grad_norms": grad_norms(trainer), "weights": full_weights(trainer.model)}


def bf16_checkpoint() -> dict[str, Any]:
    """A bfloat16 checkpoint trained with bf16=True: plain Trainer trains the bf16 weights themselves, FSDP2Trainer
    fp32 masters computing in bf16 (compared loosely, apart); the export is bf16 again, as saved."""
    trainer = TrainerClass(
        _by_path("llama_bf16"), args("bf16_checkpoint", bf16=True), train_dataset=make_dataset(32, 96)
    )
    trainer.train()
    export = os.path.join(RUN_DIR, "bf16_checkpoint_export")
    trainer.save_model(export)
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad})
    exported = {}
    if RANK == 0:
        from safetensors import safe_open

        with safe_open(os.path.join(export, "model.safetensors"), "pt") as f:
            exported = sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})
    return {"losses": losses(trainer), "trained_dtypes": dtypes, "exported_dtypes": exported}


def lora_new_tokens() -> dict[str, Any]:
    """LoRA after adding tokens: resize_token_embeddings, then embed_tokens and lm_head in modules_to_save."""
    from peft import LoraConfig, get_peft_model

    model = causal_model()
    model.resize_token_embeddings(100)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]
    )
    model = get_peft_model(model, lora)
    trainer = TrainerClass(model, args("lora_new_tokens"), train_dataset=make_dataset(32, 100))
    trainer.train()
    return {"losses": losses(trainer), "weights": full_weights(trainer.model, trainable_only=True)}


def grad_norms(trainer: Trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        plain_module,
        scalar_resume,
        custom_pretrained,
        second_trainer,
        model_init,
        best_model_and_early_stopping,
        predict,
        custom_optimizer,
        iterable_dataset,
        gradient_checkpointing,
        subclass,
        seq2seq_own_loss,
        clip,
        hyperparameter_search,
        torch_compile,
        moe_qwen3,
        moe_mixtral,
        lora_new_tokens,
        bf16_checkpoint,
    )
}
if MODE == "fsdp2":
    SCENARIOS["refusals"] = refusals


def main() -> None:
    run_scenarios(SCENARIOS, sys.argv[5:], f"{RUN_DIR}.json")


if __name__ == "__main__":
    main()
