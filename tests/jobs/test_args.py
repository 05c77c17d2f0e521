"""Recipe command lines: YAML config + overrides → dataclasses, with the command line winning."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.jobs.args import parse_recipe_args, split_config


def write(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_values_are_typed_like_the_command_line_and_overrides_win(tmp_path):
    config = write(
        tmp_path,
        "output_dir: out\nlearning_rate: 1e-4\nbf16: false\nmax_steps: 10\n"
        "transformer_layer_cls_to_wrap: [LlamaDecoderLayer]\nreshard_after_forward: false\n",
    )
    args, fsdp = parse_recipe_args(
        (TrainingArguments, FSDP2Config),
        [config, "max_steps=3", "--learning_rate", "0.5", "--fsdp_activation_checkpointing"],
    )
    assert (args.output_dir, args.learning_rate, args.max_steps, args.bf16) == ("out", 0.5, 3, False)
    assert fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert fsdp.reshard_policy is False and fsdp.fsdp_activation_checkpointing is True


def test_config_file_is_found_positionally_or_by_flag():
    assert split_config(["a.yaml", "x=1"]) == ("a.yaml", ["x=1"])
    assert split_config(["--config", "b.yml", "--y", "2"]) == ("b.yml", ["--y", "2"])
    with pytest.raises(ValueError, match="--config needs a path"):
        split_config(["--config"])


def test_unknown_settings_are_named_with_a_suggestion(tmp_path):
    config = write(tmp_path, "output_dir: out\nlearning_rat: 1e-4\n")
    with pytest.raises(ValueError, match="learning_rat \\(did you mean learning_rate\\?\\)"):
        parse_recipe_args((TrainingArguments, FSDP2Config), [config])
    with pytest.raises(ValueError, match="does not exist"):
        parse_recipe_args((TrainingArguments,), [str(tmp_path / "missing.yaml")])


def test_use_cpu_defaults_to_true_without_an_accelerator_and_can_be_overridden(tmp_path):
    import torch

    config = write(tmp_path, "output_dir: out\n")
    (args,) = parse_recipe_args((TrainingArguments,), [config])
    assert args.use_cpu is (not torch.accelerator.is_available())
    (args,) = parse_recipe_args((TrainingArguments,), [config, "use_cpu=false"])
    assert args.use_cpu is False


def test_evaluation_without_an_eval_file_is_refused_naming_both_ways_out():
    from hf_fsdp2.jobs.args import require_eval_file

    with pytest.raises(ValueError, match=r"eval_strategy=steps .* add eval_file=eval.jsonl .* or eval_strategy=no"):
        require_eval_file(None, "steps")
    require_eval_file(None, "no")
    require_eval_file("eval.jsonl", "steps")
