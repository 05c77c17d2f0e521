"""Loading logic on one process: key matching, shape errors, and initialization of what a checkpoint lacks
exactly as single-process `from_pretrained` does it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2LMHeadModel
from transformers.trainer_utils import set_seed

from hf_fsdp2 import from_pretrained
from hf_fsdp2.loading.missing_values import init_missing
from hf_fsdp2.loading.safetensors_route import plan_safetensors_load, safetensors_shapes


def test_skeleton_reads_no_weights_and_matches_from_pretrained_structure(tiny):
    skeleton = from_pretrained(tiny("llama_tied"))
    reference = AutoModelForCausalLM.from_pretrained(tiny("llama_tied"))
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    assert {n: p.shape for n, p in skeleton.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}
    assert skeleton.dtype == reference.dtype


def test_tied_head_is_filled_from_the_embedding_key(tiny):
    skeleton = from_pretrained(tiny("llama_tied"))
    plan = plan_safetensors_load(skeleton, safetensors_shapes(tiny("llama_tied")))
    assert plan.missing == []
    assert plan.keys["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert "lm_head.weight" not in plan.keys


def test_checkpoint_keys_without_the_base_model_prefix_are_matched(tiny, tmp_path):
    """Original GPT-2 checkpoints store `h.0...` where GPT2LMHeadModel has `transformer.h.0...`."""
    from safetensors.torch import save_file

    with safe_open(f"{tiny('gpt2')}/model.safetensors", "pt") as f:
        stripped = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    save_file(stripped, str(tmp_path / "model.safetensors"))
    skeleton = from_pretrained(tiny("gpt2"))
    plan = plan_safetensors_load(skeleton, safetensors_shapes(str(tmp_path)))
    assert plan.missing == []
    assert plan.keys["transformer.h.0.attn.c_attn.weight"] == "h.0.attn.c_attn.weight"


def test_a_shape_mismatch_names_the_key(tiny):
    skeleton = from_pretrained(tiny("qwen2"))
    shapes = safetensors_shapes(tiny("llama"))  # same key names, llama has no attention biases
    shapes["model.layers.0.mlp.up_proj.weight"] = torch.Size([3, 3])
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight: the checkpoint's .* has shape \(3, 3\)"):
        plan_safetensors_load(skeleton, shapes)


def test_missing_head_is_initialized_exactly_like_from_pretrained(tiny):
    set_seed(42)
    reference = AutoModelForSequenceClassification.from_pretrained(tiny("llama"), num_labels=3)
    set_seed(42)
    skeleton = from_pretrained(tiny("llama"), AutoModelForSequenceClassification, num_labels=3)
    plan = plan_safetensors_load(skeleton, safetensors_shapes(tiny("llama")))
    assert plan.missing == ["score.weight"]
    assert "lm_head.weight" in plan.unused
    values = init_missing(skeleton, plan.missing)
    assert torch.equal(values["score.weight"], reference.score.weight)
    for name in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        assert torch.equal(values[name], reference.get_buffer(name))
    assert all(p.is_meta for p in skeleton.parameters()), "initialized tensors go back to meta until sharded"
    assert not hasattr(skeleton.model, "_is_hf_initialized"), "transformers' init flags are cleaned up"


def test_models_that_are_not_pretrained_models_cannot_init_missing_tensors():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a PreTrainedModel"):
        init_missing(model, ["weight"])


def test_non_gpt2_is_unaffected_by_prefix_logic(tiny):
    skeleton = from_pretrained(tiny("gpt2"))
    assert isinstance(skeleton, GPT2LMHeadModel)
    plan = plan_safetensors_load(skeleton, safetensors_shapes(tiny("gpt2")))
    assert plan.missing == [] and plan.unused == []


def test_values_the_checkpoint_lacks_are_in_their_shards_and_freed_before_the_checkpoint_is_read(tiny, monkeypatch):
    """LoRA's matrices, whole on every rank, must not be held while the base is read: held, they added ~11 MiB per
    rank to the benchmark's QLoRA load peak (1.24x its floor against 1.06x freed first)."""
    import weakref

    from peft import LoraConfig, get_peft_model

    import hf_fsdp2.loading.weights as loading
    from hf_fsdp2 import FSDP2Config, prepare_model

    held: list[weakref.ref] = []
    expected: dict[str, torch.Tensor] = {}
    at_read: dict[str, object] = {}
    initial_values, read = loading.initial_values, loading.read_safetensors_shards

    def recording_initial_values(*args, **kwargs):
        values = initial_values(*args, **kwargs)
        held.extend(weakref.ref(v) for v in values.values())
        expected.update({n: v.clone() for n, v in values.items() if "lora_A" in n})
        return values

    def checking_read(model, *args, **kwargs):
        at_read["still held"] = [r for r in held if r() is not None]
        at_read["lora in shards"] = all(
            torch.equal(model.get_parameter(n).full_tensor(), v) for n, v in expected.items()
        )
        return read(model, *args, **kwargs)

    monkeypatch.setattr(loading, "initial_values", recording_initial_values)
    monkeypatch.setattr(loading, "read_safetensors_shards", checking_read)
    model = get_peft_model(from_pretrained(tiny("llama")), LoraConfig(target_modules=["q_proj", "v_proj"]))
    prepare_model(model, FSDP2Config())
    assert expected and held, "LoRA's matrices are what the checkpoint lacks"
    assert at_read["still held"] == [], "full initial values were still alive when the checkpoint read began"
    assert at_read["lora in shards"] is True


def test_a_base_weight_loaded_into_the_skeleton_is_refused_naming_it(tiny):
    """The base is read from its checkpoint when sharded: a value load_state_dict put into the skeleton's meta
    tensor would otherwise vanish (torch makes that copy a no-op)."""
    from hf_fsdp2 import FSDP2Config, prepare_model

    skeleton = from_pretrained(tiny("llama"))
    skeleton.load_state_dict({"model.norm.weight": torch.ones(skeleton.model.norm.weight.shape)}, strict=False)
    with pytest.raises(ValueError, match=r"model.norm.weight: a value was loaded into the meta skeleton .* after"):
        prepare_model(skeleton, FSDP2Config())
