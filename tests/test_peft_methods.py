"""Every PEFT method peft ships, by peft's own account of its state: prompt tuning, prefix tuning, p-tuning, VeRA
and the LoRA family at 2 ranks against plain Trainer in one process; adapter-only checkpoints and exports that
`PeftModel.from_pretrained` loads to the one-process logits; AdaLoRA refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import (
    AdaLoraConfig,
    LoraConfig,
    PeftModel,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
    TrainableTokensConfig,
    get_peft_model,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainingArguments, set_seed

from hf_fsdp2 import FSDP2Config, FSDP2Trainer, from_pretrained
from hf_fsdp2.adapters.methods import check_replayable
from hf_fsdp2.checkpoints.adapters import load_adapter, save_adapter
from hf_fsdp2.loading.facts import ModelFacts
from tests.launch import run

MODEL = "llama"
NEW = ["prompt_tuning", "prefix_tuning", "p_tuning", "vera"]
LORA_FAMILY = ["rslora", "all_linear", "ia3", "loha", "lokr", "trainable_tokens"]
# peft on hf_fsdp2's skeleton and on a real base on every rank (the rank-0 route); DoRA's magnitudes are computed
# from the base weights, so it needs the real base (its refusal on a skeleton: tests/test_lora.py).
CASES = [f"skeleton/{m}" for m in NEW + LORA_FAMILY] + [f"object/{m}" for m in NEW + ["dora", "trainable_tokens"]]
PROBE = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]])
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny) -> dict[str, str]:
    """One launch of plain Trainer in one process, one 2-rank launch of FSDP2Trainer; every method in each."""
    out = str(tmp_path_factory.mktemp("peft_methods"))
    methods = sorted({case.split("/")[1] for case in CASES})
    run("peft_methods_worker.py", 0, "plain", out, tiny(MODEL), *[f"plain/{m}" for m in methods])
    run("peft_methods_worker.py", 2, "fsdp2", out, tiny(MODEL), *CASES)
    return {"out": out, "model": tiny(MODEL)}


def results(runs: dict[str, str], name: str) -> dict:
    with open(os.path.join(runs["out"], f"{name}.json")) as f:
        return json.load(f)


def reference_and_run(runs: dict[str, str], case: str) -> tuple[dict, dict]:
    got = results(runs, "fsdp2-2")[case]
    assert "error" not in got, got.get("traceback", got.get("error"))
    return results(runs, "plain-1")[f"plain/{case.split('/')[1]}"], got


def max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def peft_logits(base: str, folder: str) -> torch.Tensor:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def peft_trainable(base: str, folder: str) -> dict[str, list[float]]:
    """The adapter tensors `PeftModel.from_pretrained` loads from `folder`, by the names training gave them."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder, is_trainable=True)
    return {name: p.detach().flatten().tolist() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_plain_trainer_in_one_process(runs, case):
    ref, got = reference_and_run(runs, case)
    assert len(got["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"], strict=True)) < TOL
    assert got["trainable"] and max_diff(ref["trainable"], got["trainable"]) < TOL
    assert (torch.tensor(ref["logits"]) - torch.tensor(got["logits"])).abs().max() < TOL


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_is_adapter_only_and_it_and_the_export_load_in_peft(runs, case):
    ref, _ = reference_and_run(runs, case)
    run_dir = os.path.join(runs["out"], "fsdp2-2", case)
    checkpoint = os.path.join(run_dir, "checkpoint-4")
    names = set(os.listdir(checkpoint))
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer_0"} <= names
    assert "pytorch_model_fsdp_0" not in names and "config.json" not in names
    stored = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    base = load_file(os.path.join(runs["model"], "model.safetensors"))
    assert sum(t.numel() for t in stored.values()) < 0.25 * sum(t.numel() for t in base.values()), "no base weight"
    if case.endswith("vera"):  # the shared projections, saved as peft saves them (save_projection=True)
        assert {"base_model.vera_A", "base_model.vera_B"} <= set(stored)
    if case.endswith("trainable_tokens"):  # the trained rows, under peft's key, equal to one process's
        key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
        trained = torch.tensor(ref["trainable"][f"{key}.default"]).view(5, 32)
        assert stored[key].shape == (5, 32) and (stored[key] - trained).abs().max() < TOL
    expected = torch.tensor(ref["logits"])
    for folder in (checkpoint, run_dir):  # the last checkpoint, and the end-of-training export
        assert (peft_logits(runs["model"], folder) - expected).abs().max() < TOL, folder
        if case.endswith("trainable_tokens"):  # peft reloads the trained rows themselves
            assert max_diff(ref["trainable"], peft_trainable(runs["model"], folder)) < TOL, folder


# ---- fast, single-process --------------------------------------------------------------------------


def test_adapter_state_is_peft_s_account_not_name_patterns(tiny):
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    prompt = ModelFacts.of(get_peft_model(from_pretrained(tiny(MODEL)), config))
    assert prompt.base_root == "base_model"  # no tuner wrapper: the transformers model is base_model itself
    assert prompt.adapter_tensors == {"prompt_encoder.default.embedding.weight"}


def test_adalora_is_refused_by_name_with_the_alternative(tmp_path, tiny):
    config = AdaLoraConfig(init_r=4, target_r=2, total_step=4, target_modules=["q_proj", "v_proj"])
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    for base in (from_pretrained(tiny(MODEL)), AutoModelForCausalLM.from_pretrained(tiny(MODEL))):
        with pytest.raises(ValueError, match="adapter 'default' is AdaLoRA.*read whole lora_A.*Use LoRA instead"):
            FSDP2Trainer(get_peft_model(base, config), args, fsdp2_config=FSDP2Config(consolidate_on_train_end=False))


def test_prompt_tuning_resumes_from_its_adapter_file_and_p_tuning_is_refused(tmp_path, tiny):
    configs = {
        "prompt": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "prefix": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }
    for name, config in configs.items():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny(MODEL)), config)
        save_adapter(model, str(tmp_path / name))
        weight = model.prompt_encoder["default"].embedding.weight
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.add_(1.0)
        load_adapter(model, str(tmp_path / name))
        assert torch.equal(weight, saved), name
    p_tuning = PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny(MODEL)), p_tuning)
    save_adapter(model, str(tmp_path / "p_tuning"))
    with pytest.raises(ValueError, match="not the encoder's weights, so training cannot resume"):
        load_adapter(model, str(tmp_path / "p_tuning"))


def test_prompt_tuning_initialized_from_the_vocabulary_on_a_skeleton_is_refused(tiny):
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = get_peft_model(from_pretrained(tiny(MODEL)), config)
    # peft draws from the vocabulary's embeddings, which a skeleton does not have: replaying it would give zeros.
    model.peft_config["default"].prompt_tuning_init = "SAMPLE_VOCAB"
    with pytest.raises(ValueError, match="prompt_tuning_init='SAMPLE_VOCAB' .* meta skeleton"):
        check_replayable(model, from_pretrained(tiny(MODEL)))


TOKEN_CONFIGS = {
    "lora": lambda: LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5, 90]),
    "random_rows": lambda: TrainableTokensConfig(
        target_modules=["embed_tokens"], token_indices=[3, 5, 90], init_weights=False
    ),
}


@pytest.mark.parametrize(("model", "method"), [("llama", "lora"), ("llama_tied", "lora"), ("llama", "random_rows")])
def test_trainable_tokens_on_a_skeleton_start_as_peft_starts_them_on_the_real_base(tmp_path, tiny, model, method):
    """The rows peft copies from the base embedding (delta and original) are read from the checkpoint, random rows
    (init_weights=False) are drawn as peft draws them; a replay on the weightless stand-in alone gave zero rows."""
    set_seed(0)
    real = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny(model)), TOKEN_CONFIGS[method]())
    set_seed(0)
    skeleton = get_peft_model(from_pretrained(tiny(model)), TOKEN_CONFIGS[method]())
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = FSDP2Trainer(skeleton, args, fsdp2_config=FSDP2Config(consolidate_on_train_end=False))
    want = {n: t for n, t in [*real.named_parameters(), *real.named_buffers()] if "trainable_tokens" in n}
    got = {n: t for n, t in [*trainer.model.named_parameters(), *trainer.model.named_buffers()] if n in want}
    assert len(want) == 2 and want.keys() == got.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor, want[name]), name
