"""Which modules become FSDP units, and fp32 master upcasting; pure logic on meta models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.sharding.units import (
    _check_reshard,
    mixed_precision_policy,
    scalar_parameters,
    select_units,
    upcast_trainable,
)
from tests.tiny_models import gpt2, llama


def meta(builder, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return builder(*args, **kwargs)


def test_transformer_based_wrap_picks_the_decoder_layers():
    model = meta(llama, layers=3)
    units = select_units(model, FSDP2Config())
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 3


def test_a_policy_that_matches_nothing_lists_the_model_classes():
    with pytest.raises(ValueError) as error:
        select_units(meta(llama), FSDP2Config(transformer_layer_cls_to_wrap=["Foo"]))
    message = str(error.value)
    assert "no module matched transformer_layer_cls_to_wrap=['Foo']" in message
    assert "LlamaDecoderLayer" in message and "LlamaRMSNorm" in message


def test_no_wrap_makes_the_root_the_only_unit():
    assert select_units(meta(llama), FSDP2Config(auto_wrap_policy="no_wrap")) == []


@pytest.mark.parametrize("builder", [lambda: llama(tied=True), gpt2])
def test_size_based_wrap_never_splits_tied_embedding_and_head(builder):
    model = meta(builder)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    units = select_units(model, FSDP2Config(auto_wrap_policy="size_based_wrap", min_num_params=1000))
    assert units, "tiny blocks exceed 1000 parameters and should be units"
    for unit in units:
        owned = set(map(id, unit.modules()))
        assert (id(embedding) in owned) == (id(head) in owned), f"{type(unit).__name__} splits the tie"


def test_size_based_wrap_picks_smallest_modules_first():
    model = meta(llama)
    units = select_units(model, FSDP2Config(auto_wrap_policy="size_based_wrap", min_num_params=1000))
    unit_ids = {id(u) for u in units}
    # Every attention projection (32x32 = 1024 params) is a unit, so its layer does not need to be.
    assert id(model.model.layers[0].self_attn.q_proj) in unit_ids


def test_a_callable_that_splits_a_tie_is_refused():
    model = meta(llama, tied=True)
    with pytest.raises(ValueError, match="split tied weights"):
        select_units(model, FSDP2Config(auto_wrap_policy=lambda m: isinstance(m, nn.Embedding)))


def test_a_model_without_no_split_modules_gets_size_based_units_or_the_root_alone():
    model = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40), nn.Linear(2, 2))
    units = select_units(model, FSDP2Config(min_num_params=1000))
    assert units == [model[0], model[1]], "each 1640-parameter Linear is a unit, the tiny one stays with the root"
    assert select_units(model, FSDP2Config()) == [], "below the default 100M threshold: the root alone"


def test_declared_blocks_the_model_lacks_fall_back_to_size_but_explicit_ones_fail():
    model = nn.Sequential(nn.Linear(4, 4))
    model._no_split_modules = ["GoneBlock"]
    assert select_units(model, FSDP2Config()) == []
    with pytest.raises(ValueError, match=r"no module matched transformer_layer_cls_to_wrap=\['GoneBlock'\]"):
        select_units(model, FSDP2Config(transformer_layer_cls_to_wrap=["GoneBlock"]))


def test_scalar_parameters_are_found_for_fsdp_to_leave_whole():
    model = nn.Sequential(nn.Linear(2, 2))
    model.logit_scale = nn.Parameter(torch.tensor(2.6))
    assert scalar_parameters(model) == [model.logit_scale]


def test_upcast_makes_trainable_bf16_params_fp32_and_keeps_ties():
    model = meta(llama, tied=True).to(torch.bfloat16)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    upcast_trainable(model, mixed_precision_policy(FSDP2Config(), bf16=True, fp16=False))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16, "frozen params stay low precision"
    assert model.model.layers[1].mlp.up_proj.weight.dtype == torch.float32


class _ShardGroup:
    """The one question _check_reshard asks a mesh: the size of its shard dimension."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self, dim: int) -> int:
        return self._size


def test_an_int_reshard_size_must_divide_the_shard_group():
    for accepted in (True, False, 1, 2, 4):
        _check_reshard(accepted, _ShardGroup(4))
    with pytest.raises(ValueError, match="reshard_after_forward=3 does not divide the shard group size 4"):
        _check_reshard(3, _ShardGroup(4))
    with pytest.raises(ValueError, match="reshard_after_forward=2 does not divide the shard group size 3"):
        _check_reshard(2, _ShardGroup(3))  # smaller than the group, and still not a divisor
