"""Optimizers a Trainer user picks, through plain `Trainer` (one process, the reference) or `FSDP2Trainer`.

Usage: optim_worker.py {plain,fsdp2} OUT LLAMA [SCENARIO ...]; rank 0 writes OUT/{mode}-{world}.json: scenario ->
losses and weights, or the error. A scenario named `optim=NAME` trains with TrainingArguments(optim=NAME); the others
are below. A scenario's resume (`*_resume`) trains 4 steps saving at 2, then resumes a fresh trainer from checkpoint-2
written at this world size and, when OUT/fsdp2-2/ holds one, from the one the 2-rank run wrote.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_fsdp2.distributed import agree
from tests.launch import ROOT
from tests.workers.scenarios import full_weights, losses, parity_arguments, run_scenarios
from tests.workers.train_worker import make_dataset

# The state counter of the measurement script, so the test and the docs' table count bytes the same way.
sys.path.insert(0, os.path.join(ROOT, "scripts", "measure"))
from measure_optimizer_state import state_bytes_of  # noqa: E402

MODE, OUT, LLAMA = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH = 4
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")
TWO_RANK_DIR = os.path.join(OUT, "fsdp2-2")
NS_DTYPE = os.environ.get("NS_DTYPE", "float32")

if MODE == "fsdp2":
    from hf_fsdp2 import FSDP2Trainer

    TrainerClass: type[Trainer] = FSDP2Trainer
else:
    TrainerClass = Trainer


def args(name: str, **overrides: Any) -> TrainingArguments:
    """The per-device batch keeps the global batch equal at any world size; fp32, constant learning rate."""
    return parity_arguments(os.path.join(RUN_DIR, name), GLOBAL_BATCH // WORLD, **{"learning_rate": 1e-3, **overrides})


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(LLAMA)


def train(name: str, **kwargs: Any) -> dict[str, Any]:
    """Train 4 steps; losses and gathered weights."""
    trainer = TrainerClass(model(), args(name, **kwargs.pop("args", {})), train_dataset=make_dataset(32, 96), **kwargs)
    trainer.train()
    result = {"losses": losses(trainer), "weights": full_weights(trainer.model), "optimizer": _optimizer_name(trainer)}
    if name == "muon":
        result["groups"] = muon_groups(trainer)
    # Rank 0's state, and the sum over ranks (the test compares it with the planner's figure at this world size).
    state = float(state_bytes_of(trainer.optimizer))
    result["per_rank"] = {"state_bytes": state}  # differs by world size: not compared across runs
    result["state_bytes_all_ranks"] = agree([state], "sum")[0]
    return result


def _optimizer(trainer: Trainer) -> torch.optim.Optimizer:
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def _optimizer_name(trainer: Trainer) -> str:
    return type(_optimizer(trainer)).__name__


def resume(name: str, **kwargs: Any) -> dict[str, Any]:
    """Train 4 steps saving at 2; resume fresh trainers from checkpoint-2 (this world size's, the 2-rank run's)."""
    extra = kwargs.pop("args", {})
    first = TrainerClass(
        model(), args(name, save_strategy="steps", save_steps=2, **extra), train_dataset=make_dataset(32, 96), **kwargs
    )
    first.train()
    result: dict[str, Any] = {"losses": losses(first), "per_rank": {}}
    sources = {"same": os.path.join(RUN_DIR, name, "checkpoint-2")}
    if MODE == "fsdp2" and WORLD != 2:
        sources["from_2_ranks"] = os.path.join(TWO_RANK_DIR, name, "checkpoint-2")
    for source, checkpoint in sources.items():
        torch.manual_seed(1)  # other starting weights: everything must come from the checkpoint
        second = TrainerClass(
            model(), args(f"{name}_{source}", **extra), train_dataset=make_dataset(32, 96), **_fresh(kwargs)
        )
        second.train(resume_from_checkpoint=checkpoint)
        result["per_rank"][source] = losses(second)[2:]  # resumed losses, compared with losses[2:] by the test
    return result


def _fresh(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Trainer keyword arguments for a second trainer (an optimizer instance cannot be shared)."""
    return {k: v for k, v in kwargs.items() if k != "optimizers"}


# hf_fsdp2.Muon's runs: TrainingArguments set AdamW's part and the weight decay of both, `optim_args` Muon's momentum,
# the factory's keywords Muon's learning rate (torch's scale) and Newton–Schulz dtype; the scheduler decays every group.
MUON_ARGS = dict(
    learning_rate=3e-4, weight_decay=0.05, adam_beta2=0.99, optim_args="momentum=0.9", lr_scheduler_type="linear"
)
MUON_KEYWORDS = {"lr": 0.02, "adjust_lr_fn": None, "ns_dtype": NS_DTYPE}


def muon_kwargs(name: str) -> dict[str, Any]:
    """FSDP2Trainer hands the factory its TrainingArguments; plain Trainer does not, so the reference passes them."""
    from hf_fsdp2 import Muon

    kwargs = dict(MUON_KEYWORDS, **({"training_args": args(name, **MUON_ARGS)} if MODE == "plain" else {}))
    return {"optimizer_cls_and_kwargs": (Muon, kwargs), "args": MUON_ARGS}


def muon_groups(trainer: Trainer) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters after training, with its parameters' names."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    keys = ("use_muon", "lr", "initial_lr", "weight_decay", "momentum", "adjust_lr_fn", "betas", "eps")
    return [
        {**{k: g[k] for k in keys if k in g}, "names": sorted(names[id(p)] for p in g["params"])}
        for g in _optimizer(trainer).param_groups
    ]


def torch_muon() -> dict[str, Any]:
    """torch.optim.Muon passed in `optimizers` over the hidden matrices (Trainer re-points it at the shards)."""
    net = model()
    matrices = [p for n, p in net.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    trainer = TrainerClass(
        net,
        args("torch_muon"),
        train_dataset=make_dataset(32, 96),
        optimizers=(torch.optim.Muon(matrices, lr=0.02), None),
    )
    trainer.train()
    return {"losses": losses(trainer), "weights": full_weights(trainer.model), "optimizer": _optimizer_name(trainer)}


SCENARIOS = {
    "muon": lambda: train("muon", **muon_kwargs("muon")),
    "muon_resume": lambda: resume("muon_resume", **muon_kwargs("muon_resume")),
    "torch_muon": torch_muon,
}


def scenario(name: str) -> Any:
    """A scenario by name; `optim=NAME` and `optim=NAME:resume` are built on demand."""
    if name in SCENARIOS:
        return SCENARIOS[name]
    optim, _, what = name.removeprefix("optim=").partition(":")
    label = name.replace("=", "_").replace(":", "_")
    extra: dict[str, Any] = {"optim": optim}
    if optim.startswith(("galore", "apollo")):  # they project only the modules named here
        extra["optim_target_modules"] = ["self_attn", "mlp"]
        # A rank below the matrices' sizes and a new projection every other step, so the projection matters.
        extra["optim_args"] = "rank=4, update_proj_gap=2"
    if what == "resume":
        return lambda: resume(label, args=extra)
    return lambda: train(label, args=extra)


def main() -> None:
    chosen = sys.argv[4:] or list(SCENARIOS)
    run_scenarios({name: scenario(name) for name in chosen}, chosen, f"{RUN_DIR}.json")


if __name__ == "__main__":
    main()
