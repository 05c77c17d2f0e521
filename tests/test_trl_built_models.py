"""TRL trainers that build their model from a path themselves, through hf_fsdp2: TRL's RewardTrainer given a causal
LM's path (its documented usage: it builds a num_labels=1 classifier) or a reward checkpoint's path, and KTOTrainer,
whose reference model TRL builds too. The model TRL asked for is what gets sharded: 2 ranks give the per-step losses
and weights of plain one-process TRL (KTO: of TRL under DDP at 2 ranks, since its KL term pairs each rank's rows).
DPO and KTO with precompute_ref_log_probs=True: the cache is named with one process's hash of the weights, the
precomputed reference log-probs and the training match, and TRL's own refusal of an IterableDataset comes through."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)

from tests.launch import load_runs, run
from tests.test_dropin import differences

pytest.importorskip("trl")

REWARD = ["reward_causal_path", "reward_seqcls_path"]
# The run each scenario must equal: one process, or DDP at 2 ranks where the method itself depends on the ranks.
REFERENCE = {
    "reward_causal_path": "plain-1",
    "reward_seqcls_path": "plain-1",
    "kto_full": "plain-2",
    "dpo_precompute": "plain-1",
    "dpo_precompute_ref": "plain-1",
    "dpo_precompute_iterable": "plain-1",
    "kto_precompute": "plain-2",
}
ONE_PROCESS = [name for name, reference in REFERENCE.items() if reference == "plain-1"]
DDP = [name for name, reference in REFERENCE.items() if reference == "plain-2"]


@pytest.fixture(scope="module")
def built_runs(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl_built")
    checkpoint = ["--reward-checkpoint", tiny("llama_reward")]
    # kto_precompute runs in one process too: its cache must carry one process's hash.
    runs = (("plain", 0, [*ONE_PROCESS, "kto_precompute"]), ("plain", 2, DDP), ("fsdp2", 2, list(REFERENCE)))
    for mode, nproc, scenarios in runs:
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


@pytest.mark.parametrize("scenario", ["dpo_precompute", "dpo_precompute_ref", "kto_precompute"])
def test_precompute_cache_is_named_as_one_process_names_it(built_runs, scenario):
    """TRL hashes the weights it precomputes with (the separate reference, else the policy) to name its cache."""
    ours, one_process = built_runs["fsdp2-2"][scenario], built_runs["plain-1"][scenario]
    assert len(ours["cache_hash"]) == 64 and ours["cache_hash"] == one_process["cache_hash"]
    if scenario == "dpo_precompute_ref":  # the separate reference's hash, not the policy's
        assert ours["cache_hash"] != built_runs["plain-1"]["dpo_precompute"]["cache_hash"]
    # The precompute's no-grad forwards ran in __init__; the policy is handed back sharded all the same.
    assert ours["fsdp2_only"]["parameter_types_after_init"] == ["DTensor"]


def test_trl_refusal_of_an_iterable_dataset_with_precompute_reaches_the_user(built_runs):
    message = built_runs["fsdp2-2"]["dpo_precompute_iterable"]["error_message"]
    assert message.startswith("`precompute_ref_log_probs=True` is not supported with IterableDataset")


def test_kto_reference_model_is_sharded_frozen(built_runs):
    facts = built_runs["fsdp2-2"]["kto_full"]["fsdp2_only"]
    assert facts["ref_sharded"] and facts["ref_trainable"] == 0
    assert facts["read_by_slices"], "TRL's policy and reference, built from the path, are read by slices"


def test_a_trainer_that_takes_paths_builds_them_as_skeletons(tiny):
    """In the window, from_pretrained of a path builds the skeleton of exactly that call (class and config overrides
    from the Auto class); our own loading reads weights; the original from_pretrained is back afterwards."""
    from transformers import AutoModelForSequenceClassification, PreTrainedModel

    from hf_fsdp2.loading.path_models import check_all_sharded, loading_for_real, skeletons_for_paths

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


def test_a_path_with_positional_arguments_is_refused_by_name_not_loaded_whole(tmp_path, tiny):
    """Positional arguments after the path go to the model's __init__; the skeleton is built from keywords, so the
    call is refused with both fixes instead of loading the whole model on every rank."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_fsdp2 import FSDP2Mixin
    from hf_fsdp2.loading.path_models import skeletons_for_paths

    refusal = r"LlamaForCausalLM.from_pretrained\(.*llama', \.\.\.\) was called with 1 positional argument"
    with skeletons_for_paths(), pytest.raises(ValueError, match=refusal + ".*by keyword.*pass the object"):
        AutoModelForCausalLM.from_pretrained(tiny("llama"), "extra")

    class BuildsFromPath(Trainer):
        def __init__(self, model: str | PreTrainedModel, args: TrainingArguments) -> None:
            super().__init__(AutoModelForCausalLM.from_pretrained(model, "extra"), args)

    class Sharded(FSDP2Mixin, BuildsFromPath):
        pass

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="1 positional argument"):
        Sharded(tiny("llama"), args)


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
    """The sharded model holds the values of the model the same trainer builds in one plain process: the class, the
    config overrides (num_labels=1) and every weight, the classifier head's seeded initialisation included."""
    import torch
    from torch.distributed.tensor import DTensor

    from hf_fsdp2 import FSDP2Mixin
    from hf_fsdp2.loading.facts import unwrap_peft

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    path = tiny("llama")  # before seeding: saving it the first time draws from the generator
    torch.manual_seed(0)
    # Plain Trainer cannot take a path: the trainer that builds nothing gets what from_pretrained gives instead.
    reference = base(path if base is ClassifierTrainer else AutoModelForCausalLM.from_pretrained(path), args).model
    torch.manual_seed(0)
    trainer = type(f"FSDP2{base.__name__}", (FSDP2Mixin, base), {})(path, args)
    model = unwrap_peft(trainer.model)
    assert type(model).__name__ in (built, f"FSDP{built}") and type(reference).__name__ == built
    ours = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    expected = reference.state_dict()
    assert sorted(ours) == sorted(expected)
    unequal = [k for k in expected if not torch.equal(ours[k], expected[k])]
    assert not unequal, f"loaded values differ from the one-process trainer's: {unequal}"
