"""The TrainingArguments GPU users switch on, tried with FSDP2Trainer: fp16 with its gradient scaler,
auto_find_batch_size after an out-of-memory error, bf16/fp16 full evaluation.

Usage: switches_worker.py OUT LLAMA [SCENARIO ...]; rank 0 writes OUT/switches-{WORLD}.json.
Every run trains the tiny Llama on the same global batch of 4 rows at any world size (arguments_worker's rows).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import GradScalerKwargs
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, TrainerCallback

import hf_fsdp2.trainer.batch_size as batch_size
from hf_fsdp2 import FSDP2Trainer
from tests.workers.scenarios import full_weights, losses, parity_arguments, run_scenarios
from tests.workers.train_worker import make_dataset

OUT, LLAMA = sys.argv[1:3]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
GLOBAL_BATCH = 4
RUN_DIR = os.path.join(OUT, f"switches-{WORLD}")
# A meeting that fails to gather every rank fails in seconds here, not after 5 minutes (no rank computes for long).
batch_size.MEETING_TIMEOUT = timedelta(seconds=30)


def train(name: str, trainer_class: type = FSDP2Trainer, accumulate: int = 1, resume: str | None = None, **overrides):
    """Train the tiny Llama 4 steps on the global batch of 4 (in `accumulate` micro-batches); the trainer."""
    torch.manual_seed(0)
    per_device = GLOBAL_BATCH // WORLD // accumulate
    args = parity_arguments(
        os.path.join(RUN_DIR, name), per_device, gradient_accumulation_steps=accumulate, **overrides
    )
    trainer = trainer_class(AutoModelForCausalLM.from_pretrained(LLAMA), args, train_dataset=make_dataset(32, 96))
    trainer.add_callback(ScaleLog(trainer))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


class ScaleLog(TrainerCallback):
    """The loss scale after each optimizer step, and whether Accelerate saw the step skipped (both per rank)."""

    def __init__(self, trainer: FSDP2Trainer) -> None:
        self.trainer, self.scales, self.skipped = trainer, [], []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scaler = self.trainer.accelerator.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else None)
        self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


def scale_log(trainer: FSDP2Trainer) -> ScaleLog:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, ScaleLog))


def result(trainer: FSDP2Trainer) -> dict[str, Any]:
    """Losses, weights (gathered) and the scaler's history of a finished run."""
    log = scale_log(trainer)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"losses": losses(trainer), "weights": full_weights(trainer.model), "scales": log.scales, "norms": norms}


def fp16() -> dict[str, Any]:
    """fp16 compute, fp32 masters, the global batch in one micro-batch per rank. No clipping: the global norm sums
    the ranks' parts in another order than one process, and fp16's rounding of the weights magnifies that."""
    trainer = train("fp16", fp16=True, max_grad_norm=0.0)
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    return {**result(trainer), "master_dtypes": dtypes, "skipped": scale_log(trainer).skipped}


def fp16_accumulated() -> dict[str, Any]:
    """The same run with the global batch in two micro-batches of two rows: at one process, the same rows per
    forward as each of 2 ranks computes, summed in fp32 (exactly 2 ranks' run); against `fp16`, fp16's noise floor."""
    return result(train("fp16_accumulated", accumulate=2, fp16=True, max_grad_norm=0.0))


def fp16_clipped() -> dict[str, Any]:
    """fp16 with clipping at 1.0: the norm is taken of unscaled gradients, so it is fp32's norm."""
    return result(train("fp16_clipped", fp16=True))


def fp32() -> dict[str, Any]:
    """The clipped run in fp32: fp16 must stay close to it, and differ (it really computed in fp16)."""
    return result(train("fp32"))


class InfOnRank1(FSDP2Trainer):
    """After the backward of optimizer step 2, rank 1 writes an inf into its own shard of one gradient."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step == OVERFLOW_STEP - 1 and dist.get_rank() == 1:
            grad = self.model.get_input_embeddings().weight.grad
            grad.to_local().view(-1)[0] = float("inf")
        return loss


OVERFLOW_STEP = 2


class ShardWatch(TrainerCallback):
    """Whether this rank's shards changed in each optimizer step."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.changed: list[bool] = []
        self.model: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.before = [_local(p).detach().clone() for p in model.parameters()]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        after = [_local(p) for p in self.model.parameters()]
        self.changed.append(any(not torch.equal(b, a) for b, a in zip(self.before, after, strict=True)))


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def overflow() -> dict[str, Any]:
    """An inf in rank 1's shard only, at step 2: every rank skips that step and halves the scale."""
    watch = ShardWatch()
    torch.manual_seed(0)
    args = parity_arguments(os.path.join(RUN_DIR, "overflow"), GLOBAL_BATCH // WORLD, fp16=True)
    trainer = InfOnRank1(AutoModelForCausalLM.from_pretrained(LLAMA), args, train_dataset=make_dataset(32, 96))
    trainer.add_callback(ScaleLog(trainer))
    trainer.add_callback(watch)
    trainer.train()
    log = scale_log(trainer)
    mine = {"changed": watch.changed, "scales": log.scales, "skipped": log.skipped, "lr": _learning_rates(trainer)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"losses": losses(trainer), "ranks": every}


def _learning_rates(trainer: FSDP2Trainer) -> list[float]:
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


class DynamicScaleTrainer(FSDP2Trainer):
    """fp16 with a scale that doubles after every good step, so steps overflow and are skipped now and then: which
    ones depends on the scaler's state, which a resume must bring back."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["kwargs_handlers"].append(GradScalerKwargs(init_scale=INIT_SCALE, growth_interval=1))
        return accelerator_args


INIT_SCALE = 2.0**20
RESUME_STEPS = dict(max_steps=8, save_strategy="steps", save_steps=4, lr_scheduler_type="linear")


def resume() -> dict[str, Any]:
    """8 steps with a checkpoint at 4; resumed from it; and resumed from a copy without scaler.pt (which must differ:
    the test shows the scaler's state matters to the loss curve)."""
    whole = train("resume", DynamicScaleTrainer, fp16=True, **RESUME_STEPS)
    checkpoint = os.path.join(whole.args.output_dir, "checkpoint-4")
    has_scaler = os.path.isfile(os.path.join(checkpoint, "scaler.pt"))
    resumed = train("resume_again", DynamicScaleTrainer, resume=checkpoint, fp16=True, **RESUME_STEPS)
    bare = os.path.join(RUN_DIR, "resume_bare", "checkpoint-4")
    if RANK == 0:
        shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("scaler.pt"))
    dist.barrier()
    without = train("resume_bare", DynamicScaleTrainer, resume=bare, fp16=True, **RESUME_STEPS)
    return {
        "whole": result(whole),
        "resumed": result(resumed),
        "without_scaler": result(without),
        "skipped": scale_log(whole).skipped,
        "has_scaler_file": has_scaler,
    }


def evaluated(name: str, **overrides: Any) -> dict[str, Any]:
    """evaluate() before training, then 4 steps evaluating after each: eval losses, and the training's losses and
    weights (which evaluation must not change)."""
    overrides = {"eval_strategy": "steps", "eval_steps": 1, **overrides}
    torch.manual_seed(0)
    args = parity_arguments(os.path.join(RUN_DIR, name), GLOBAL_BATCH // WORLD, **overrides)
    trainer = FSDP2Trainer(
        AutoModelForCausalLM.from_pretrained(LLAMA),
        args,
        train_dataset=make_dataset(32, 96),
        eval_dataset=make_dataset(8, 96, seed=1),
    )
    # Outside train() too (plain Trainer would cast the model in place there): before training and after it.
    first = [trainer.evaluate()["eval_loss"]] if args.eval_strategy != "no" else []
    trainer.train()
    during = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    evals = first + during + ([trainer.evaluate()["eval_loss"]] if first else [])
    dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
    return {"losses": losses(trainer), "weights": full_weights(trainer.model), "evals": evals, "master_dtypes": dtypes}


def eval_fp32() -> dict[str, Any]:
    """Evaluation in fp32, as trained."""
    return evaluated("eval_fp32")


def eval_bf16() -> dict[str, Any]:
    """bf16_full_eval: every evaluation computes in bf16."""
    return evaluated("eval_bf16", bf16_full_eval=True)


def eval_fp16() -> dict[str, Any]:
    """fp16_full_eval: every evaluation computes in fp16."""
    return evaluated("eval_fp16", fp16_full_eval=True)


def eval_never() -> dict[str, Any]:
    """The same training, never evaluated: evaluations in another dtype must leave it exactly as it is."""
    return evaluated("eval_never", eval_strategy="no")


OOM_STEP = 2  # the step whose first attempt runs out of memory


def injected_oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected by the test)")


class OutOfMemoryInOptimizerStep(TrainerCallback):
    """Rank 1's optimizer step of OOM_STEP runs out of memory (as Adam's first state allocation can), once."""

    def __init__(self) -> None:
        self.done = False

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        inner = optimizer.optimizer  # Accelerate's wrapper calls this one's step
        step = inner.step

        def step_or_fail(*step_args: Any, **step_kwargs: Any) -> Any:
            if state.global_step == OOM_STEP - 1 and dist.get_rank() == 1 and not self.done:
                self.done = True
                raise injected_oom()
            return step(*step_args, **step_kwargs)

        inner.step = step_or_fail


def out_of_memory_in_forward(trainer: FSDP2Trainer, ranks: tuple[int, ...]) -> None:
    """On `ranks`, the second block's forward runs out of memory at OOM_STEP while each rank's batch has 2 rows."""
    block = trainer.model.model.layers[1]

    def fail(module: Any, inputs: Any) -> None:
        rows = inputs[0].shape[0]
        if trainer.state.global_step == OOM_STEP - 1 and dist.get_rank() in ranks and rows == 2:
            raise injected_oom()

    block.register_forward_pre_hook(fail)


def oom_run(name: str, callback: TrainerCallback | None = None, forward_ranks: tuple[int, ...] = ()) -> dict[str, Any]:
    """4 steps with auto_find_batch_size from 2 rows per rank, a checkpoint at step 2; what batch size it ends with."""
    torch.manual_seed(0)
    args = parity_arguments(
        os.path.join(RUN_DIR, name), 2, auto_find_batch_size=True, save_strategy="steps", save_steps=2
    )
    trainer = FSDP2Trainer(AutoModelForCausalLM.from_pretrained(LLAMA), args, train_dataset=make_dataset(32, 96))
    if callback is not None:
        trainer.add_callback(callback)
    if forward_ranks:
        out_of_memory_in_forward(trainer, forward_ranks)
    trainer.train()
    with open(os.path.join(args.output_dir, "checkpoint-2", "trainer_state.json")) as f:
        saved = json.load(f)["train_batch_size"]
    mine = {"batch": trainer._train_batch_size, "state": trainer.state.train_batch_size, "saved": saved}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"losses": losses(trainer), "ranks": every, "steps": trainer.state.global_step}


def oom_optimizer() -> dict[str, Any]:
    """Rank 1 alone runs out of memory in its optimizer step: every rank retries with the smaller batch."""
    return oom_run("oom_optimizer", callback=OutOfMemoryInOptimizerStep())


def oom_forward_everywhere() -> dict[str, Any]:
    """Every rank runs out of memory in the same block's forward (rows of one length): every rank retries."""
    return oom_run("oom_forward_everywhere", forward_ranks=(0, 1))


def oom_forward_one_rank() -> None:
    """Rank 1 alone runs out of memory in a forward while rank 0 goes on into the next collective: rank 1 fails,
    naming itself and the step, after the meeting's timeout (here 3 s); its error ends the process, as in a script,
    and the launcher stops rank 0. Run on its own (not through run_scenarios, which would record the error)."""
    batch_size.MEETING_TIMEOUT = timedelta(seconds=3)
    oom_run("oom_forward_one_rank", forward_ranks=(1,))


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        fp16,
        fp16_accumulated,
        fp16_clipped,
        fp32,
        overflow,
        resume,
        oom_optimizer,
        oom_forward_everywhere,
        eval_fp32,
        eval_bf16,
        eval_fp16,
        eval_never,
    )
}

if __name__ == "__main__":
    if sys.argv[3:] == ["oom_forward_one_rank"]:
        oom_forward_one_rank()
    else:
        run_scenarios(SCENARIOS, sys.argv[3:], f"{RUN_DIR}.json")
