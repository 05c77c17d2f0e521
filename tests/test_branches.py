"""Branches: the modules a rank may skip in a step (a VLM's vision tower on a text-only batch) are found by
structure, kept out of per-layer units, and counted by the planner as gathered with the root. Pure logic on
meta models; the 2-rank training runs are in tests/test_vlm.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.loading.branches import find_branches
from hf_fsdp2.planning.model_sizes import skeleton_sizes
from hf_fsdp2.sharding.units import select_units
from tests.tiny_models import llama
from tests.tiny_vlms import FAMILIES

EXPECTED = {
    "llava": (["model.vision_tower", "model.multi_modal_projector"], "model.language_model"),
    "qwen2_vl": (["model.visual"], "model.language_model"),
    "qwen2_5_vl": (["model.visual"], "model.language_model"),
    "gemma3": (["model.vision_tower", "model.multi_modal_projector"], "model.language_model"),
    "smolvlm": (["model.vision_model", "model.connector"], "model.text_model"),
}


def meta(builder) -> nn.Module:
    with torch.device("meta"):
        return builder()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_vlm_s_encoders_and_projectors_are_its_branches(family):
    assert find_branches(meta(FAMILIES[family].build)) == EXPECTED[family]


def test_a_text_model_has_no_branches():
    assert find_branches(meta(llama)) == ([], None)


def test_branches_are_found_inside_a_peft_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(meta(FAMILIES["llava"].build), LoraConfig(r=2, target_modules=["q_proj"]))
    branches, language = find_branches(model)
    assert branches == ["base_model.model.model.vision_tower", "base_model.model.model.multi_modal_projector"]
    assert language == "base_model.model.model.language_model"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_unit_lies_inside_a_branch(family):
    model = meta(FAMILIES[family].build)
    branches, _ = find_branches(model)
    names = {id(m): n for n, m in model.named_modules()}
    units = [names[id(u)] for u in select_units(model, FSDP2Config())]
    assert units and not [u for u in units if any(u.startswith(b) for b in branches)]
    assert all(".layers." in u for u in units)  # the language model's decoder layers stay units


def test_a_named_branch_is_kept_whole_and_an_unknown_one_is_refused():
    model = meta(lambda: llama(layers=3))
    units = select_units(model, FSDP2Config(branch_modules=["model.layers.1"]))
    assert [n for n, m in model.named_modules() if m in units] == ["model.layers.0", "model.layers.2"]
    with pytest.raises(ValueError, match="branch_modules names 'vision_tower', which is no module of"):
        select_units(model, FSDP2Config(branch_modules=["vision_tower"]))


def test_the_planner_gathers_a_kept_tower_with_the_root():
    model = meta(FAMILIES["llava"].build)
    tower = sum(p.numel() for p in model.model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    head_and_embeddings = model.lm_head.weight.numel() + model.model.language_model.embed_tokens.weight.numel()
    sizes = skeleton_sizes(model.config, None, bf16=False)
    assert sizes.root_numel >= tower + projector + head_and_embeddings
    layer = sum(p.numel() for p in model.model.language_model.layers[0].parameters())
    assert sizes.largest_unit_numel == layer
