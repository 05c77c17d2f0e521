"""Every TrainingArguments field has a verdict under FSDP2Trainer (honoured, refused, or no effect on training), so a
field a new transformers adds fails here until someone decides; the fields no other test set are tried at 2 ranks
against plain Trainer (one process; DDP at 2 ranks for NEFTune, whose noise each rank draws), and each refused field
fails at construction with a message naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from transformers import TrainingArguments

from hf_fsdp2.trainer.argument_verdicts import VERDICTS
from tests.launch import load_runs, run
from tests.test_dropin import differences

PARITY = ["label_smoothing", "tokens_seen", "empty_cache", "group_by_length", "save_only_model"]
REFERENCE = {**dict.fromkeys(PARITY, "plain-1"), "restore_callback_states": "plain-1", "neftune": "plain-2"}


def test_every_training_arguments_field_has_a_verdict():
    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    missing = sorted(fields - set(VERDICTS))
    assert not missing, (
        f"TrainingArguments fields without a verdict in hf_fsdp2/trainer/argument_verdicts.py: {missing}"
    )
    assert not sorted(set(VERDICTS) - fields), "verdicts for fields TrainingArguments no longer has"
    assert all(verdict in ("honoured", "refused", "no effect") and why for verdict, why in VERDICTS.values())


@pytest.fixture(scope="module")
def argument_runs(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("arguments")
    one_process = [name for name, reference in REFERENCE.items() if reference == "plain-1"]
    for mode, nproc, scenarios in (
        ("plain", 0, one_process),
        ("plain", 2, ["neftune"]),
        ("fsdp2", 2, [*REFERENCE, "refusals"]),
    ):
        run("arguments_worker.py", nproc, mode, str(out), tiny("llama"), *scenarios, timeout=600)
    return load_runs(out, "plain-1", "plain-2", "fsdp2-2")


@pytest.mark.parametrize("scenario", list(REFERENCE))
def test_honoured_fields_train_as_plain_trainer(argument_runs, scenario):
    ours = argument_runs["fsdp2-2"][scenario]
    reference = argument_runs[REFERENCE[scenario]][scenario]
    assert "error" not in ours, ours.get("traceback")
    assert "error" not in reference, reference.get("traceback")
    found = differences(reference, ours, scenario)
    assert not found, "\n".join(found[:10])


def test_the_scenarios_check_what_they_claim(argument_runs):
    ours = argument_runs["fsdp2-2"]
    assert ours["tokens_seen"]["num_input_tokens_seen"] > 0
    assert not ours["save_only_model"]["has_optimizer"] and not ours["save_only_model"]["has_scheduler"]
    assert ours["neftune"]["hooks_left"] == 0, "NEFTune's hook stays on the embeddings after train()"
    restored = ours["restore_callback_states"]
    # resumed at step 2 of 4: without the restored state the counter would count steps 3 and 4 only
    assert restored["counter"] >= 3 and restored["counter_after_resume"] == restored["counter"]


def test_refused_fields_fail_at_construction_naming_the_field(argument_runs):
    refused = {name for name, (verdict, _) in VERDICTS.items() if verdict == "refused"}
    tried = argument_runs["fsdp2-2"]["refusals"]
    assert set(tried) == refused, "each refused field needs an example value in arguments_worker.py"
    for name, outcome in argument_runs["fsdp2-2"]["refusals"].items():
        if "arguments_error" in outcome:  # TrainingArguments refuses it first here (deepspeed is not installed)
            continue
        assert "refused" in outcome, f"{name} was accepted"
        assert name in outcome["refused"], outcome["refused"]
