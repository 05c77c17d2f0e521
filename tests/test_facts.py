"""ModelFacts: one description of the model, built once and read by every later stage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from peft import LoraConfig, get_peft_model

from hf_fsdp2 import from_pretrained
from hf_fsdp2.loading.facts import ModelFacts, attached_facts, describe, facts_of


def test_facts_of_a_tied_skeleton(tiny):
    skeleton = from_pretrained(tiny("llama_tied"))
    facts = ModelFacts.of(skeleton)
    assert facts.tie_groups == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert facts.tie_map == {"model.embed_tokens.weight": ["model.embed_tokens.weight", "lm_head.weight"]}
    assert facts.num_params == len(list(skeleton.parameters()))
    assert not facts.is_peft and facts.adapter_names == [] and facts.adapter_tensors is None
    assert facts.source.path == tiny("llama_tied")


def test_facts_of_a_peft_model(tiny):
    peft = get_peft_model(from_pretrained(tiny("llama_tied")), LoraConfig(r=2, target_modules=["q_proj"]))
    peft.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"]))
    facts = ModelFacts.of(peft)
    assert facts.is_peft and facts.base_root == "base_model.model"
    # Adapter state by peft's account: both adapters' LoRA matrices, nothing of the base.
    assert len(facts.adapter_tensors) == 2 * 2 * 2 and all(".lora_" in name for name in facts.adapter_tensors)
    assert facts.adapter_names == ["default", "second"]
    assert facts.tie_groups == [["base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"]]
    assert facts.source.path == tiny("llama_tied"), "the skeleton's source is reached through the PEFT wrapper"


def test_describe_attaches_and_a_wrapper_does_not_answer_with_the_inner_models_facts(tiny):
    base = from_pretrained(tiny("llama"))
    facts = describe(base)
    assert facts_of(base) is facts and attached_facts(base) is facts
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    # PeftModel forwards unknown attributes to the model inside; the base's (non-PEFT) facts must not leak out.
    assert attached_facts(peft) is None
    assert facts_of(peft).is_peft


def test_verify_names_an_untied_weight_and_a_tensor_left_on_meta(tiny):
    skeleton = from_pretrained(tiny("llama_tied"))
    facts = ModelFacts.of(skeleton)
    with pytest.raises(RuntimeError, match="model.embed_tokens.weight is still on the meta device"):
        facts.verify(skeleton)
    skeleton.to_empty(device="cpu")  # to_empty gives each owner of a shared Parameter its own copy
    with pytest.raises(RuntimeError, match="lm_head.weight is no longer tied to model.embed_tokens.weight"):
        facts.verify(skeleton)


_PIPELINE = """
import os, sys
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, TrainingArguments
import hf_fsdp2.loading.facts as facts_module
from hf_fsdp2 import FSDP2Trainer, from_pretrained
from hf_fsdp2.loading.facts import attached_facts

calls = []
original = facts_module.ModelFacts.of.__func__
facts_module.ModelFacts.of = classmethod(lambda cls, model: calls.append(model) or original(cls, model))
model = from_pretrained(sys.argv[1], AutoModelForSequenceClassification, num_labels=3)
data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "labels": [0, 1, 2, 0]})
args = TrainingArguments(sys.argv[2], max_steps=2, save_steps=1, per_device_train_batch_size=2, use_cpu=True,
                         report_to=[], logging_steps=1)
trainer = FSDP2Trainer(model, args, train_dataset=data)
trainer.train()
trainer.save_model(os.path.join(sys.argv[2], "final"))
# Other models (the memory plan's own meta skeleton) may be described too; the trained one only once.
assert sum(m is model for m in calls) == 1, calls
assert attached_facts(model).missing == ["score.weight"], attached_facts(model).missing
print("ok")
"""


def test_load_shard_train_save_export_describe_the_model_once(tiny, tmp_path):
    """Followed through FSDP2Trainer (load, shard, train, checkpoints, export), the model is described once."""
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(29500 + os.getpid() % 1000)
    command = [sys.executable, "-c", textwrap.dedent(_PIPELINE), tiny("llama"), str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
