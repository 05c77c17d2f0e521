"""sentence-transformers through FSDP2Mixin: SentenceTransformerTrainer at 2 ranks trains as one process (or as DDP
where the loss itself depends on the ranks), and every folder it writes is sentence-transformers' own format, which
`SentenceTransformer(folder)` reloads to the trained embeddings (not a transformers folder it would fill with random
weights); a user's module with its own save_pretrained is written by it."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from tests.launch import load_runs, run
from tests.tiny_models import llama, save_tiny_sentence_transformer

pytest.importorskip("sentence_transformers")

# Which run each scenario must equal: one process, or DDP at 2 ranks where in-batch negatives come from each rank's
# own rows (MultipleNegativesRankingLoss without gather_across_devices differs from one process by design).
REFERENCE = {"cosine": "plain-1", "mnrl": "plain-2", "mnrl_gather": "plain-1"}


@pytest.fixture(scope="module")
def st_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("st")
    model = save_tiny_sentence_transformer(str(tmp_path_factory.mktemp("tiny_st")))
    for mode, nproc, scenarios in (
        ("plain", 0, ["cosine", "mnrl_gather"]),
        ("plain", 2, ["mnrl"]),
        ("fsdp2", 2, [*REFERENCE, "own_save"]),
    ):
        run("st_worker.py", nproc, mode, str(out), model, *scenarios, timeout=600)
    return load_runs(out, "plain-1", "plain-2", "fsdp2-2")


def largest_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("scenario", list(REFERENCE))
def test_export_reloads_to_the_trained_embeddings(st_runs, scenario):
    ours, reference = st_runs["fsdp2-2"][scenario], st_runs[REFERENCE[scenario]][scenario]
    assert "error" not in ours, ours.get("traceback")
    assert "error" not in reference, reference.get("traceback")  # plain Trainer's run, the reference
    assert largest_difference(ours["losses"], reference["losses"]) <= 1e-5
    assert "modules.json" in ours["export_files"] and ours["export_files"] == reference["export_files"]
    assert largest_difference(ours["embeddings"], reference["embeddings"]) <= 1e-4


def test_every_folder_written_is_sentence_transformers_format(st_runs):
    ours = st_runs["fsdp2-2"]["cosine"]["fsdp2_only"]
    trained = st_runs["plain-1"]["cosine"]["embeddings"]
    # the live sharded model after the export still encodes as trained (the export put everything back)
    assert largest_difference(ours["live"], trained) <= 1e-4
    # the end-of-training export (ConsolidateCallback) and the sharded model's collective save_pretrained
    assert largest_difference(ours["train_end_export"], trained) <= 1e-4
    assert largest_difference(ours["save_pretrained"], trained) <= 1e-4
    # resumed from checkpoint-2 (DCP) and exported: the uninterrupted run's embeddings
    assert largest_difference(ours["resumed"], trained) <= 1e-4
    # a checkpoint holds the weights in DCP only: no config.json that would make it look loadable
    assert "pytorch_model_fsdp_0" in ours["checkpoint_files"] and "config.json" not in ours["checkpoint_files"]


def test_a_users_module_is_exported_by_its_own_save_pretrained(st_runs):
    """Not only sentence-transformers: FSDP2Trainer writes a user's module with the module's own save_pretrained."""
    ours = st_runs["fsdp2-2"]["own_save"]
    assert "error" not in ours, ours.get("traceback")
    assert "own_format.pt" in ours["export_files"] and "config.json" not in ours["export_files"]
    assert ours["largest_difference"] <= 1e-6, "the folder reloads to other weights than the trained ones"


class OwnFormat(nn.Module):
    """A user's module that writes its own folder."""

    def save_pretrained(self, directory: str) -> None:
        raise NotImplementedError


def test_who_writes_a_models_folder():
    from hf_fsdp2.export.owner import owner_save

    def trainer_save(directory: str) -> None:
        raise NotImplementedError

    assert owner_save(llama(), trainer_save) is None, "a PreTrainedModel is streamed in save_pretrained's format"
    assert owner_save(nn.Linear(2, 2), None) is None, "a plain module: its state dict, as Trainer._save writes"
    assert owner_save(nn.Linear(2, 2), trainer_save) is trainer_save
    with pytest.raises(NotImplementedError):  # the module's own save_pretrained is what writes its folder
        owner_save(OwnFormat(), None)("folder")


class Wrapper(nn.Module):
    """A model wrapper whose `save(dir)` is unrelated to exports (here: it must never run)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, x, labels=None):
        return {"logits": self.body(x)}

    def save(self, directory: str) -> None:
        raise AssertionError("an export called Wrapper.save")


def test_a_method_merely_named_save_is_not_called_and_the_model_is_exported_as_its_state_dict(tmp_path):
    """Old rule: any callable `save` counted as the owner's folder format and was called by save_model."""
    from safetensors.torch import load_file
    from transformers import TrainingArguments

    from hf_fsdp2 import FSDP2Trainer
    from hf_fsdp2.export.owner import owner_save

    assert owner_save(Wrapper(), None) is None
    trainer = FSDP2Trainer(Wrapper(), TrainingArguments(str(tmp_path / "run"), report_to=[], use_cpu=True))
    trainer.save_model(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(saved) == ["body.bias", "body.weight"] and saved["body.weight"].shape == (2, 4)
