"""LoRA (peft) through FSDP2Trainer: parity with one process, adapter-only checkpoints that peft loads,
exact resume on other world sizes, merged export equal to peft's merge_and_unload, clear errors."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainingArguments

from hf_fsdp2 import FSDP2Config, FSDP2Trainer, consolidate, from_pretrained
from hf_fsdp2.adapters.methods import check_replayable
from hf_fsdp2.checkpoints.adapters import check_trainable_are_saved, load_adapter, save_adapter
from tests.launch import load_result, run, run_batch

MODEL = "llama_tied"
LORA = ("--lora", "q_proj,v_proj,down_proj", "--save-steps", "2", "--steps", "4")
PROBE = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]])
TOL = 1e-5


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny) -> str:
    """One process, peft on a real model (peft's own initialization), the adapter folder exported at the end."""
    out = str(tmp_path_factory.mktemp("lora_one"))
    run("train_worker.py", 0, "--model", tiny(MODEL), "--out", out, "--load", "object", *LORA)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny) -> str:
    """Two ranks, peft on a meta skeleton, adapter-only checkpoints, the merged model exported at the end."""
    out = str(tmp_path_factory.mktemp("lora_two"))
    run(
        "train_worker.py",
        2,
        "--model",
        tiny(MODEL),
        "--out",
        out,
        "--load",
        "from_pretrained",
        "--merge-adapters",
        *LORA,
    )
    return out


def adapters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if "lora_" in k}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def peft_logits(base: str, adapter_folder: str) -> torch.Tensor:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_folder).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def test_two_ranks_on_a_skeleton_match_one_process(one_process, two_ranks, tiny):
    ref, got = load_result(one_process), load_result(two_ranks)
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"], strict=True)) < TOL
    ref_w, got_w = (
        torch.load(os.path.join(one_process, "weights.pt")),
        torch.load(os.path.join(two_ranks, "weights.pt")),
    )
    assert len(adapters(ref_w)) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    assert max_diff(adapters(ref_w), adapters(got_w)) < TOL
    # The adapters moved; the frozen base did not (and is the checkpoint's, bit for bit).
    base = AutoModelForCausalLM.from_pretrained(tiny(MODEL)).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(got_w[f"base_model.model.{key.replace('q_proj.', 'q_proj.base_layer.')}"], base[key])
    assert any(v.abs().sum() > 0 for k, v in adapters(got_w).items() if "lora_B" in k)


def test_checkpoints_are_adapter_only_and_load_in_peft(two_ranks, tiny):
    checkpoint = os.path.join(two_ranks, "run", "checkpoint-4")
    names = set(os.listdir(checkpoint))
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer_0"} <= names
    assert "pytorch_model_fsdp_0" not in names and "config.json" not in names
    stored = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    assert stored and all("lora_" in k for k in stored), "no frozen weight is written"
    assert len(glob.glob(os.path.join(checkpoint, "optimizer_0", "*.distcp"))) == 2
    adapter_bytes = os.path.getsize(os.path.join(checkpoint, "adapter_model.safetensors"))
    base_bytes = os.path.getsize(os.path.join(tiny(MODEL), "model.safetensors"))
    assert adapter_bytes < 0.25 * base_bytes
    # The checkpoint folder is itself a peft adapter folder: same logits as the trained sharded model.
    logits = torch.tensor(load_result(two_ranks)["logits"])
    assert torch.allclose(peft_logits(tiny(MODEL), checkpoint), logits, atol=TOL)


def test_end_of_training_adapter_folder_round_trips_through_peft(one_process, tiny):
    run_dir = os.path.join(one_process, "run")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(run_dir))
    assert not glob.glob(os.path.join(run_dir, "model*.safetensors"))
    logits = torch.tensor(load_result(one_process)["logits"])
    assert torch.allclose(peft_logits(tiny(MODEL), run_dir), logits, atol=TOL)


def test_merged_export_equals_peft_merge_and_unload(two_ranks, tiny):
    checkpoint = os.path.join(two_ranks, "run", "checkpoint-4")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny(MODEL)), checkpoint)
    expected = reference.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(two_ranks, "run"))
    assert max_diff(merged.state_dict(), expected) < 1e-6
    with torch.no_grad():
        logits = merged(input_ids=PROBE).logits
    assert torch.allclose(logits, torch.tensor(load_result(two_ranks)["logits"]), atol=TOL)


def relaunch(out: str, run_dir: str, model: str, *flags: str) -> list[str]:
    """Worker flags of a relaunch with --resume auto in `run_dir` (seeded with a checkpoint beforehand)."""
    return ["--model", model, "--out", out, "--run-dir", run_dir, "--load", "from_pretrained", *flags, *LORA]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, two_ranks, tiny) -> dict[str, str]:
    """Runs resumed from two_ranks' adapter checkpoints: from checkpoint-2 at 2 ranks and in one process, and
    a relaunch of the finished run (checkpoint-4 is max_steps) at 2 ranks, sharing the 2-rank launch."""
    root = tmp_path_factory.mktemp("lora_resumed")
    out = {name: str(root / name) for name in ("resumed-2", "resumed-0", "finished")}
    for name, checkpoint in (
        ("resumed-2", "checkpoint-2"),
        ("resumed-0", "checkpoint-2"),
        ("finished", "checkpoint-4"),
    ):
        shutil.copytree(os.path.join(two_ranks, "run", checkpoint), os.path.join(out[name], "run", checkpoint))
    runs = {name: relaunch(out[name], os.path.join(out[name], "run"), tiny(MODEL), "--resume", "auto") for name in out}
    runs["finished"].append("--merge-adapters")  # the same command as two_ranks', relaunched
    last = run_batch("train_worker.py", 2, [runs["resumed-2"], runs["finished"]], str(root / "batches"))
    out["log"] = last.stdout + last.stderr
    run("train_worker.py", 0, *runs["resumed-0"])
    return out


@pytest.mark.parametrize("nproc", [2, 0])
def test_resume_from_an_adapter_checkpoint_on_any_world_size(resumed, two_ranks, nproc):
    got_dir = resumed[f"resumed-{nproc}"]
    ref, got = load_result(two_ranks), load_result(got_dir)
    expected, again = (
        dict(zip(ref["steps"], ref["losses"], strict=True)),
        dict(zip(got["steps"], got["losses"], strict=True)),
    )
    for step in (3, 4):
        assert abs(again[step] - expected[step]) < TOL
    ref_w, got_w = torch.load(os.path.join(two_ranks, "weights.pt")), torch.load(os.path.join(got_dir, "weights.pt"))
    assert max_diff(adapters(ref_w), adapters(got_w)) < TOL


def test_relaunching_a_finished_lora_run_trains_nothing_and_exports_again(resumed, two_ranks):
    run_dir = os.path.join(resumed["finished"], "run")
    assert load_result(resumed["finished"])["steps_run"] == 0
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint-")) == ["checkpoint-4"]
    ref_w = torch.load(os.path.join(two_ranks, "weights.pt"))
    got_w = torch.load(os.path.join(resumed["finished"], "weights.pt"))
    assert all(torch.equal(ref_w[k], got_w[k]) for k in adapters(ref_w))
    merged = load_file(os.path.join(run_dir, "model.safetensors"))  # the merged export, redone
    first = load_file(os.path.join(two_ranks, "run", "model.safetensors"))
    assert merged.keys() == first.keys() and all(torch.equal(merged[k], first[k]) for k in first)
    assert resumed["log"].count("already reached max_steps=4: nothing left to train") == 1


def test_classification_with_modules_to_save_matches_one_process(tmp_path, tiny):
    """A new head (missing from the checkpoint) trained through modules_to_save, peft on a skeleton."""
    flags = ("--task", "classify", "--lora", "q_proj,v_proj", "--modules-to-save", "score", "--steps", "3")
    run("train_worker.py", 0, "--model", tiny("llama"), "--out", str(tmp_path / "one"), "--load", "object", *flags)
    run("train_worker.py", 2, "--model", tiny("llama"), "--out", str(tmp_path / "two"), *flags)
    ref, got = load_result(str(tmp_path / "one")), load_result(str(tmp_path / "two"))
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"], strict=True)) < TOL
    ref_w, got_w = torch.load(str(tmp_path / "one" / "weights.pt")), torch.load(str(tmp_path / "two" / "weights.pt"))
    head = "base_model.model.score.modules_to_save.default.weight"
    assert (got_w[head] - ref_w[head]).abs().max() < TOL
    assert not torch.equal(got_w[head], got_w["base_model.model.score.original_module.weight"]), "the copy trained"
    stored = load_file(str(tmp_path / "two" / "run" / "adapter_model.safetensors"))
    assert "base_model.model.score.weight" in stored


def test_a_checkpoint_saved_right_after_an_evaluation_resumes_exactly(tmp_path, tiny):
    """Evaluation (no_grad) leaves the units that keep their weights gathered into backward (the root, the last
    block) unsharded; the optimizer state of their trainable weights (a LoRA in the last block, a head trained
    through modules_to_save) must still be saved and resumed under the sharded parameters' names."""
    flags = ("--lora", "q_proj,down_proj", "--modules-to-save", "lm_head", "--save-steps", "2", "--steps", "4")
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    run("train_worker.py", 2, "--model", tiny("llama"), "--out", first, *flags, "--eval-steps", "2")
    shutil.copytree(os.path.join(first, "run", "checkpoint-2"), os.path.join(again, "run", "checkpoint-2"))
    run("train_worker.py", 2, "--model", tiny("llama"), "--out", again, *flags, "--resume", "auto")
    ref, got = load_result(first), load_result(again)
    assert got["steps_run"] == 2
    expected = dict(zip(ref["steps"], ref["losses"], strict=True))
    resumed = dict(zip(got["steps"], got["losses"], strict=True))
    assert all(abs(resumed[step] - expected[step]) < TOL for step in (3, 4))
    ref_w, got_w = torch.load(os.path.join(first, "weights.pt")), torch.load(os.path.join(again, "weights.pt"))
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    assert head in ref_w and max_diff(adapters(ref_w), adapters(got_w)) < TOL
    assert (ref_w[head] - got_w[head]).abs().max() < TOL


# ---- fast, single-process --------------------------------------------------------------------------


def lora(model, r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"), **kwargs):
    return get_peft_model(model, LoraConfig(r=r, target_modules=list(targets), **kwargs))


def test_base_names_are_what_peft_layers_wrap_whatever_the_names():
    """peft's layers say what they wrap: a base model's own module called `original_module` keeps its name (the
    segment rule dropped it), trainable tokens' base layer and any adapter's copy name their original."""
    from torch import nn

    from hf_fsdp2.loading.facts import facts_of
    from tests.tiny_models import llama

    base = llama()
    base.model.layers[0].mlp.original_module = nn.Linear(4, 4)
    model = get_peft_model(base, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"],
                                            trainable_token_indices=[3]), adapter_name="mine")  # fmt: skip
    facts = facts_of(model)
    assert {name: facts.base_name(f"base_model.model.{name}") for name in (
        "model.layers.0.mlp.original_module.weight", "model.layers.0.self_attn.q_proj.base_layer.weight",
        "lm_head.modules_to_save.mine.weight", "lm_head.original_module.weight",
        "model.embed_tokens.token_adapter.base_layer.weight",
    )} == {
        "model.layers.0.mlp.original_module.weight": "model.layers.0.mlp.original_module.weight",
        "model.layers.0.self_attn.q_proj.base_layer.weight": "model.layers.0.self_attn.q_proj.weight",
        "lm_head.modules_to_save.mine.weight": "lm_head.weight", "lm_head.original_module.weight": "lm_head.weight",
        "model.embed_tokens.token_adapter.base_layer.weight": "model.embed_tokens.weight",
    }  # fmt: skip
    assert facts.base_spellings["base_model.model.lm_head.modules_to_save.mine.weight"][1] == "mine"
    assert facts.base_spellings["base_model.model.lm_head.original_module.weight"][1] == ""


def test_the_merged_state_holds_what_peft_merge_and_unload_holds():
    """The active adapter has no copy of lm_head (another adapter trains it through modules_to_save): peft's forward and
    merge_and_unload use the original, which the substring rule dropped from the export; a base module called
    `original_module` was dropped too. Every exported tensor, merged, equals peft's merge_and_unload."""
    import copy

    from torch import nn

    from hf_fsdp2.checkpoints.adapters import merged_state
    from tests.tiny_models import llama

    torch.manual_seed(0)
    base = llama()
    base.model.layers[0].mlp.original_module = nn.Linear(4, 4)
    model = get_peft_model(base, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]), adapter_name="h")
    model.add_adapter("plain", LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["h"].weight.add_(1.0)  # a trained copy differs from the original
    for active in ("plain", "h"):
        model.set_adapter(active)
        export, merge = merged_state(model, model.state_dict())
        expected = copy.deepcopy(model).merge_and_unload().state_dict()
        assert export.keys() == expected.keys(), active
        for name, tensor in export.items():
            torch.testing.assert_close(merge(name, tensor.detach().clone()), expected[name], msg=f"{active}: {name}")


def test_adapter_from_another_base_model_is_refused(tmp_path, tiny):
    save_adapter(lora(AutoModelForCausalLM.from_pretrained(tiny("llama"))), str(tmp_path))
    with pytest.raises(ValueError, match="another base model .* or with another rank r"):
        load_adapter(lora(AutoModelForCausalLM.from_pretrained(tiny("llama")), r=8), str(tmp_path))
    with pytest.raises(ValueError, match="does not fit this model: missing"):
        load_adapter(lora(AutoModelForCausalLM.from_pretrained(tiny("gpt2")), targets=("c_attn",)), str(tmp_path))
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        load_adapter(lora(AutoModelForCausalLM.from_pretrained(tiny("llama"))), str(tmp_path / "nothing"))


def test_an_adapter_from_a_same_shaped_base_of_another_name_loads_with_a_warning(tmp_path, tiny, hf_fsdp2_records):
    """Same shapes load without error, so the name recorded in adapter_config.json is the only clue."""
    save_adapter(lora(AutoModelForCausalLM.from_pretrained(tiny("llama"))), str(tmp_path / "adapter"))
    load_adapter(lora(AutoModelForCausalLM.from_pretrained(tiny("llama"))), str(tmp_path / "adapter"))
    assert not [r for r in hf_fsdp2_records if "was trained on" in r.getMessage()], "same base: no warning"
    other = shutil.copytree(tiny("llama"), tmp_path / "other-base")
    load_adapter(lora(AutoModelForCausalLM.from_pretrained(str(other))), str(tmp_path / "adapter"))
    warned = [r.getMessage() for r in hf_fsdp2_records if "was trained on" in r.getMessage()]
    assert len(warned) == 1 and warned[0].endswith(f"loading it into {other}.")


def test_trainable_weights_outside_the_adapter_are_refused(tiny):
    model = lora(AutoModelForCausalLM.from_pretrained(tiny("llama")))
    check_trainable_are_saved(model)
    model.base_model.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="model.norm.weight is trainable but not part of any PEFT adapter"):
        check_trainable_are_saved(model)


def test_weight_dependent_init_on_a_skeleton_is_refused(tiny):
    model = lora(from_pretrained(tiny("llama")))
    # peft itself fails on meta weights for such inits; a config edited afterwards must not replay as garbage.
    model.peft_config["default"].init_lora_weights = "pissa"
    with pytest.raises(ValueError, match="init_lora_weights='pissa'.* meta skeleton"):
        check_replayable(model, from_pretrained(tiny("llama")))
    with pytest.raises(ValueError, match="use_dora=True .* meta skeleton"):
        check_replayable(lora(from_pretrained(tiny("llama")), use_dora=True), from_pretrained(tiny("llama")))


def test_an_unlisted_weight_dependent_init_is_found_by_replaying_it_on_two_stand_ins(tiny):
    """MiCA (peft 0.21) builds lora_B from the base weights' SVD; the old list of init names lacked it, so a config
    naming it (edited after get_peft_model, as above) replayed on zeros: lora_B from the SVD of a zero matrix."""
    model = lora(from_pretrained(tiny("llama")))
    model.peft_config["default"].init_lora_weights = "mica"
    with pytest.raises(ValueError, match=r"init_lora_weights='mica' and its initial .*lora_B.* meta skeleton"):
        check_replayable(model, from_pretrained(tiny("llama")))
    for init in (True, "gaussian", "orthogonal"):  # random draws only: replayed, not refused
        check_replayable(lora(from_pretrained(tiny("llama")), init_lora_weights=init), from_pretrained(tiny("llama")))


def test_merge_option_without_adapters_and_cli_on_adapter_checkpoint_are_refused(tmp_path, tiny, one_process):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="merge_adapters_on_save=True\\) needs a PEFT model"):
        FSDP2Trainer(tiny("llama"), args, fsdp2_config=FSDP2Config(merge_adapters_on_save=True))
    with pytest.raises(ValueError, match="adapter-only \\(PEFT\\) checkpoint"):
        consolidate(os.path.join(one_process, "run", "checkpoint-4"), str(tmp_path / "out"))


def test_frozen_base_stays_bf16_and_adapters_are_fp32_masters(tmp_path, tiny):
    base = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.bfloat16)
    base.save_pretrained(tmp_path / "bf16")
    model = lora(from_pretrained(str(tmp_path / "bf16"), AutoModelForSequenceClassification, num_labels=3))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, bf16=True)
    trainer = FSDP2Trainer(model, args, fsdp2_config=FSDP2Config(consolidate_on_train_end=False))
    dtypes = {(p.requires_grad, p.dtype) for p in trainer.model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}


@pytest.mark.parametrize(
    "model, kwargs, message",
    [
        (
            "llama_tied",
            {"targets": ("lm_head", "q_proj")},
            "lm_head.base_layer.weight carries a LoRA adapter but is tied",
        ),
        ("llama", {"use_dora": True}, "uses a LoRA variant \\(DoRA"),
        # the export would hold the base embedding without the trained rows
        ("llama", {"trainable_token_indices": [3, 5]}, "trains rows of .*embed_tokens \\(trainable_token_indices\\)"),
    ],
)
def test_unmergeable_adapters_are_refused_before_training(tmp_path, tiny, model, kwargs, message):
    peft_model = lora(from_pretrained(tiny(model)), **kwargs)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=message):
        FSDP2Trainer(peft_model, args, fsdp2_config=FSDP2Config(merge_adapters_on_save=True))


def test_a_truncated_adapter_checkpoint_is_named_and_skipped_by_auto_resume(tmp_path):
    from safetensors.torch import save_file

    from hf_fsdp2.checkpoints.resume import checkpoint_problem

    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    save_file({"lora_A": torch.zeros(64, 8)}, str(checkpoint / "adapter_model.safetensors"))
    (checkpoint / "adapter_config.json").write_text("{}")
    (checkpoint / "trainer_state.json").write_text("{}")
    assert checkpoint_problem(str(checkpoint)) is None
    weights = checkpoint / "adapter_model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    assert f"{weights}: truncated" in checkpoint_problem(str(checkpoint))
