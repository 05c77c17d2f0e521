"""sentence-transformers scenarios: SentenceTransformerTrainer as one process or DDP (plain), or with FSDP2Mixin
(fsdp2) on any world size; each exports with save_model and records what `SentenceTransformer(folder)` encodes.
`own_save` (fsdp2 only): a user's nn.Module with its own save_pretrained, exported by FSDP2Trainer.

Usage: st_worker.py {plain,fsdp2} OUT MODEL [SCENARIO ...]; rank 0 writes OUT/{MODE}-{WORLD}.json.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss, MultipleNegativesRankingLoss

from tests.workers.scenarios import PARITY_ADAM_EPSILON, losses, run_scenarios

MODE, OUT, MODEL = sys.argv[1:4]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
RUN_DIR = os.path.join(OUT, f"{MODE}-{WORLD}")
GLOBAL_BATCH = 8
PROBES = ["t3 t4 t5", "t10 t11", "t50 t60 t70 t80", "t90"]

if MODE == "fsdp2":
    from hf_fsdp2 import FSDP2Mixin

    class Trainer(FSDP2Mixin, SentenceTransformerTrainer):
        pass
else:
    Trainer = SentenceTransformerTrainer


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(3, 96, (n,), generator=g))


def pairs(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = [(words(g, 5), words(g, 4), float(torch.rand((), generator=g))) for _ in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(("sentence1", "sentence2", "score"))})


def anchors(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(1)
    return Dataset.from_dict({"anchor": [words(g, 5) for _ in range(n)], "positive": [words(g, 4) for _ in range(n)]})


def arguments(name: str, **overrides: Any) -> SentenceTransformerTrainingArguments:
    return SentenceTransformerTrainingArguments(
        **{
            "output_dir": os.path.join(RUN_DIR, name),
            "per_device_train_batch_size": GLOBAL_BATCH // WORLD,
            "max_steps": 3,
            "learning_rate": 1e-3,
            "adam_epsilon": PARITY_ADAM_EPSILON,  # compared element-wise across world sizes: see its definition
            "lr_scheduler_type": "constant",
            "logging_steps": 1,
            "report_to": [],
            "use_cpu": True,
            "disable_tqdm": True,
            "seed": 11,
            **overrides,
        }
    )


def encode(folder: str) -> list[float]:
    """The probes' embeddings from `folder` as sentence-transformers itself loads it."""
    return SentenceTransformer(folder, device="cpu").encode(PROBES, convert_to_tensor=True).flatten().tolist()


def train_and_export(
    name: str, loss: Callable[[SentenceTransformer], torch.nn.Module], data: Dataset, **overrides: Any
) -> tuple[SentenceTransformerTrainer, dict[str, Any]]:
    """Train, export with save_model, and encode the probes with the folder reloaded by sentence-transformers."""
    model = SentenceTransformer(MODEL, device="cpu")
    trainer = Trainer(model=model, args=arguments(name, **overrides), train_dataset=data, loss=loss(model))
    trainer.train()
    export = os.path.join(RUN_DIR, f"{name}_export")
    trainer.save_model(export)
    result: dict[str, Any] = {"losses": losses(trainer)}
    if RANK == 0:
        result["embeddings"] = encode(export)
        result["export_files"] = sorted(os.listdir(export))
    return trainer, result


def cosine() -> dict[str, Any]:
    """Pairs with a similarity score; with a checkpoint, and (fsdp2) every other way the model gets written."""
    trainer, result = train_and_export("cosine", CosineSimilarityLoss, pairs(), save_strategy="steps", save_steps=2)
    if MODE != "fsdp2":
        return result
    live = trainer.model.encode(PROBES, convert_to_tensor=True).flatten().tolist()  # every rank: sharded forwards
    own = os.path.join(RUN_DIR, "cosine_save_pretrained")
    trainer.model.save_pretrained(own)  # every rank, as the collective method requires
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-2")
    model = SentenceTransformer(MODEL, device="cpu")
    resumed = Trainer(model=model, args=trainer.args, train_dataset=pairs(), loss=CosineSimilarityLoss(model))
    resumed.train(resume_from_checkpoint=checkpoint)
    resumed_export = os.path.join(RUN_DIR, "cosine_resumed_export")
    resumed.save_model(resumed_export)
    if RANK == 0:
        result["fsdp2_only"] = {
            "live": live,
            "train_end_export": encode(trainer.args.output_dir),
            "save_pretrained": encode(own),
            "resumed": encode(resumed_export),
            "checkpoint_files": sorted(os.listdir(checkpoint)),
        }
    return result


def mnrl() -> dict[str, Any]:
    """In-batch negatives from each rank's own rows (differs from one process, as under DDP)."""
    return train_and_export("mnrl", MultipleNegativesRankingLoss, anchors())[1]


def mnrl_gather() -> dict[str, Any]:
    """In-batch negatives gathered from every rank (the one-process loss)."""
    loss = lambda model: MultipleNegativesRankingLoss(model, gather_across_devices=True)  # noqa: E731
    return train_and_export("mnrl_gather", loss, anchors())[1]


class OwnFormat(torch.nn.Module):
    """A user's model that writes and reads its own folder (no PreTrainedModel)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.body(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    def save_pretrained(self, directory: str) -> None:
        torch.save(self.state_dict(), os.path.join(directory, "own_format.pt"))

    @classmethod
    def from_pretrained(cls, directory: str) -> OwnFormat:
        model = cls()
        model.load_state_dict(torch.load(os.path.join(directory, "own_format.pt"), weights_only=True))
        return model


def own_save() -> dict[str, Any]:
    """FSDP2Trainer (Trainer's own _save) exports a user's module with the module's own save_pretrained."""
    from hf_fsdp2 import FSDP2Trainer
    from tests.workers.scenarios import full_weights

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    data = Dataset.from_dict({"x": x.tolist(), "labels": (x.sum(-1) * 0.3).tolist()})
    torch.manual_seed(0)
    trainer = FSDP2Trainer(OwnFormat(), arguments("own_save", learning_rate=1e-2), train_dataset=data)
    trainer.train()
    trained = full_weights(trainer.model)
    export = os.path.join(RUN_DIR, "own_save_export")
    trainer.save_model(export)
    if RANK != 0:
        return {}
    reloaded = OwnFormat.from_pretrained(export).state_dict()
    return {
        "export_files": sorted(os.listdir(export)),
        "largest_difference": max(
            float((reloaded[k].flatten() - torch.tensor(v)).abs().max()) for k, v in trained.items()
        ),
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {f.__name__: f for f in (cosine, mnrl, mnrl_gather)}
if MODE == "fsdp2":
    SCENARIOS["own_save"] = own_save

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[4:], f"{RUN_DIR}.json")
