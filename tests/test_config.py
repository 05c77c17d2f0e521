"""FSDP2Config: every invalid value raises a ValueError that names it and the fix; precision defaults."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.sharding.units import mixed_precision_policy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"auto_wrap_policy": "layer_wrap"}, "auto_wrap_policy='layer_wrap' is not valid; choose one of"),
        ({"transformer_layer_cls_to_wrap": []}, "transformer_layer_cls_to_wrap=[] names no class"),
        ({"min_num_params": 0}, "min_num_params=0 must be >= 1"),
        ({"param_dtype": "fp8"}, "param_dtype='fp8' is not valid; choose one of ['float32', 'bfloat16', 'float16']"),
        ({"reduce_dtype": "half"}, "reduce_dtype='half' is not valid"),
        ({"reduce_dtype": "float16"}, "reduce_dtype='float16' is not supported"),
        ({"hsdp_replicate_size": 0}, "hsdp_replicate_size=0 must be an int >= 1"),
        ({"reshard_after_forward": "sometimes"}, "reshard_after_forward='sometimes' is not valid"),
        ({"reshard_after_forward": 0}, "reshard_after_forward=0 is not valid"),
    ],
)
def test_invalid_values_raise_with_the_fix(kwargs, message):
    with pytest.raises(ValueError) as error:
        FSDP2Config(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("text, value", [("true", True), ("False", False), ("2", 2), (True, True), (4, 4)])
def test_reshard_after_forward_accepts_command_line_spellings(text, value):
    config = FSDP2Config(reshard_after_forward=text)
    assert config.reshard_policy == value
    assert isinstance(config.reshard_after_forward, str), "the field holds what its annotation says"


def test_block_classes_accept_a_comma_separated_string():
    config = FSDP2Config(transformer_layer_cls_to_wrap="LlamaDecoderLayer, Qwen2DecoderLayer")
    assert config.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer", "Qwen2DecoderLayer"]


def test_callable_policy_is_accepted_and_summarized():
    def is_block(module: torch.nn.Module) -> bool:
        return False

    assert FSDP2Config(auto_wrap_policy=is_block).to_summary()["auto_wrap_policy"].endswith("is_block")


def test_hf_argument_parser_reads_the_config_beside_training_arguments():
    """One parser for both: no FSDP2Config field may share a name with a TrainingArguments field."""
    args, config = HfArgumentParser((TrainingArguments, FSDP2Config)).parse_args_into_dataclasses(
        [
            "--output_dir",
            "o",
            "--auto_wrap_policy",
            "size_based_wrap",
            "--min_num_params",
            "1000",
            "--defer_gradient_sync",
            "true",
            "--fsdp_activation_checkpointing",
            "--activation_checkpointing",
            "false",
        ],
    )
    assert config.fsdp_activation_checkpointing and not args.activation_checkpointing
    assert config.auto_wrap_policy == "size_based_wrap"
    assert config.min_num_params == 1000
    assert config.defer_gradient_sync is True


def test_bf16_defaults_to_bf16_compute_and_fp32_reduction():
    policy = mixed_precision_policy(FSDP2Config(), bf16=True, fp16=False)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_no_mixed_precision_by_default():
    policy = mixed_precision_policy(FSDP2Config(), bf16=False, fp16=False)
    assert (policy.param_dtype, policy.reduce_dtype) == (None, None)


def test_explicit_dtypes_win_over_training_arguments():
    policy = mixed_precision_policy(FSDP2Config(param_dtype="float32"), bf16=True, fp16=False)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float32, None)


def test_fp16_computes_in_float16_and_reduces_in_float32():
    policy = mixed_precision_policy(FSDP2Config(), bf16=False, fp16=True)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)


@pytest.mark.parametrize(
    "config, bf16, message",
    [
        (FSDP2Config(), True, "bf16=True, fp16=True"),
        (FSDP2Config(param_dtype="bfloat16"), False, "fp16=True) with FSDP2Config(param_dtype='bfloat16')"),
    ],
)
def test_fp16_with_another_compute_dtype_is_refused_by_name(config, bf16, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mixed_precision_policy(config, bf16=bf16, fp16=True)


def test_docs_configuration_reference_is_generated_from_the_dataclass():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "docs", "config_reference.py")
    proc = subprocess.run(
        [sys.executable, script, "--check", os.path.join(root, "docs", "reference", "config.md")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def test_checkpoint_writes_names_its_choices():
    from hf_fsdp2 import FSDP2Config

    assert FSDP2Config().checkpoint_writes == "cached"  # a resume on the same machine reads from memory
    expected = r"checkpoint_writes='odirect' is not valid; choose one of \['cached', 'direct'\]"
    with pytest.raises(ValueError, match=expected):
        FSDP2Config(checkpoint_writes="odirect")
