"""TRL trainers that build their model from a path themselves, through hf_fsdp2: TRL's RewardTrainer given a causal
LM's path (its documented usage: it builds a num_labels=1 classifier) or a reward checkpoint's path, and KTOTrainer,
whose reference model TRL builds too. The model TRL asked for is what gets sharded: 2 ranks give the per-step losses
and weights of plain one-process TRL (KTO: of TRL under DDP at 2 ranks, since its KL term pairs each rank's rows)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoModelForSequenceClassification, PreTrainedModel, Trainer, TrainingArguments

from tests.launch import load_runs, run
from tests.test_dropin import differences

pytest.importorskip("trl")

REWARD = ["reward_causal_path", "reward_seqcls_path"]
# The run each scenario must equal: one process, or DDP at 2 ranks where the method itself depends on the ranks.
REFERENCE = {"reward_causal_path": "plain-1", "reward_seqcls_path": "plain-1", "kto_full": "plain-2"}


@pytest.fixture(scope="module")
def built_runs(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl_built")
    checkpoint = ["--reward-checkpoint", tiny("llama_reward")]
    for mode, nproc, scenarios in (("plain", 0, REWARD), ("plain", 2, ["kto_full"]), ("fsdp2", 2, list(REFERENCE))):
        run("trl_worker.py", nproc, mode, str(out), tiny("llama"), *scenarios, *checkpoint, timeout=900)
    return load_runs(out, "plain-1", "plain-2", "fsdp2-2")


@pytest.mark.parametrize("scenario", list(REFERENCE))
def test_two_ranks_match_the_same_trl_trainer(built_runs, scenario):
    ours = built_runs["fsdp2-2"][scenario]
    assert "error" not in ours, ours.get("traceback")
    reference = built_runs[REFERENCE[scenario]][scenario]
    assert "error" not in reference, reference.get("traceback")
    ours = {k: v for k, v in ours.items() if k != "fsdp2_only"}
    found = differences(reference, ours, scenario)
    assert not found, "\n".join(found[:10])


@pytest.mark.parametrize("scenario", REWARD)
def test_reward_model_is_the_classifier_trl_builds(built_runs, scenario):
    model = built_runs["fsdp2-2"][scenario]["model"]
    assert model == {"class": "LlamaForSequenceClassification", "num_labels": 1}
    # built as our skeleton of TRL's call, so each rank read only its slices of the checkpoint
    assert built_runs["fsdp2-2"][scenario]["fsdp2_only"]["read_by_slices"]
    assert model == built_runs["plain-1"][scenario]["model"]


def test_kto_reference_model_is_sharded_frozen(built_runs):
    facts = built_runs["fsdp2-2"]["kto_full"]["fsdp2_only"]
    assert facts["ref_sharded"] and facts["ref_trainable"] == 0
    assert facts["read_by_slices"], "TRL's policy and reference, built from the path, are read by slices"


def test_a_trainer_that_takes_paths_builds_them_as_skeletons(tiny):
    """In the window, from_pretrained of a path builds the skeleton of exactly that call (class and config overrides
    from the Auto class); our own loading reads weights; the original from_pretrained is back afterwards."""
    from transformers import AutoModelForSequenceClassification, PreTrainedModel

    from hf_fsdp2.path_models import check_all_sharded, loading_for_real, skeletons_for_paths

    original = PreTrainedModel.__dict__["from_pretrained"]
    with skeletons_for_paths() as built:
        skeleton = AutoModelForSequenceClassification.from_pretrained(tiny("llama"), num_labels=1, device_map=None)
        with loading_for_real():
            real = AutoModelForSequenceClassification.from_pretrained(tiny("llama_reward"))
    assert built == [skeleton] and PreTrainedModel.__dict__["from_pretrained"] is original
    assert type(skeleton).__name__ == "LlamaForSequenceClassification" and skeleton.config.num_labels == 1
    assert all(p.is_meta for p in skeleton.parameters()) and not any(p.is_meta for p in real.parameters())
    with pytest.raises(RuntimeError, match="built LlamaForSequenceClassification from .*llama in its __init__"):
        check_all_sharded(built)


class ClassifierTrainer(Trainer):
    """Builds a one-label classifier from a path itself; its `model` has no annotation (the old rule read "str" in
    the annotation, so it was handed a causal LM skeleton instead)."""

    def __init__(self, model, args=None, **kwargs):
        if isinstance(model, str):
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
        super().__init__(model=model, args=args, **kwargs)


class DeclaringTrainer(Trainer):
    """Declares `str | PreTrainedModel` but builds nothing (the old rule passed it the path, and Trainer failed)."""

    def __init__(self, model: str | PreTrainedModel, args=None, **kwargs):
        super().__init__(model=model, args=args, **kwargs)


@pytest.mark.parametrize(
    ("base", "built"), [(ClassifierTrainer, "LlamaForSequenceClassification"), (DeclaringTrainer, "LlamaForCausalLM")]
)
def test_whether_a_trainer_builds_its_model_from_a_path_is_what_it_does_not_what_it_declares(
    tmp_path, tiny, base, built
):
    from hf_fsdp2 import FSDP2Mixin
    from hf_fsdp2.facts import unwrap_peft

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = type(f"FSDP2{base.__name__}", (FSDP2Mixin, base), {})(tiny("llama"), args)
    model = unwrap_peft(trainer.model)
    assert type(model).__name__ in (built, f"FSDP{built}")
    assert not any(p.is_meta for p in model.parameters()), "the skeleton was loaded and sharded"
    assert Trainer.__dict__["__init__"].__qualname__ == "Trainer.__init__", "Trainer.__init__ is back"
