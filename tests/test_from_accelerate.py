"""Settings from Trainer + Accelerate's FSDP2 plugin carried into FSDP2Config: `TrainingArguments(fsdp_config=...)`
and the environment `accelerate launch --use_fsdp` exports, parsed by Accelerate's own plugin. Pure logic; the
2-rank runs (losses, activation checkpointing really on, a real `accelerate launch`) are in
tests/test_from_accelerate_runs.py."""

from __future__ import annotations

import logging

import pytest
from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.trainer.from_accelerate import resolve_config

# What `accelerate launch --use_fsdp --fsdp_version 2 ...` exports when given no other FSDP flag (accelerate 1.15).
LAUNCH_DEFAULTS = {
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false", "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_FORWARD_PREFETCH": "false", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}  # fmt: skip


@pytest.fixture
def caplog(caplog, monkeypatch):
    """Records of hf_fsdp2's loggers, which hang under transformers' (it does not propagate by default)."""
    import transformers

    monkeypatch.setattr(transformers.logging.get_logger(), "propagate", True)
    caplog.set_level(logging.INFO, logger="hf_fsdp2")
    return caplog


def fsdp_args(**fsdp_config) -> TrainingArguments:
    return TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, fsdp=True, fsdp_config=fsdp_config)


def test_fsdp_config_becomes_fsdp2_config_and_accelerate_no_longer_shards(caplog):
    args = fsdp_args(
        version=2, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=True,
        reshard_after_forward=False, state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=True,
    )  # fmt: skip
    config = resolve_config(None, args)
    assert config.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert config.fsdp_activation_checkpointing is True
    assert config.reshard_after_forward == "false" and config.auto_wrap_policy == "transformer_based_wrap"
    assert not args.fsdp and args.fsdp_plugin_args is None  # Trainer builds no FSDP plugin: no second sharding
    carried = [r.getMessage() for r in caplog.records if "Carried over from" in r.getMessage()]
    assert len(carried) == 1 and "fsdp_activation_checkpointing=True" in carried[0]
    assert any("always RAM-efficient" in r.getMessage() for r in caplog.records)
    assert resolve_config(None, args) == config  # a second trainer built with the same arguments


def test_an_fsdp2_config_field_the_user_set_wins_and_the_log_says_so(caplog):
    args = fsdp_args(version=2, activation_checkpointing=True, reshard_after_forward=False)
    with caplog.at_level(logging.INFO, logger="hf_fsdp2"):
        config = resolve_config(FSDP2Config(reshard_after_forward="2"), args)
    assert config.reshard_after_forward == "2" and config.fsdp_activation_checkpointing is True
    assert any(
        "FSDP2Config wins over" in r.getMessage() and "reshard_after_forward" in r.getMessage() for r in caplog.records
    )


def test_size_based_and_no_wrap_policies_carry_over():
    size = resolve_config(None, fsdp_args(version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000))
    assert size.auto_wrap_policy == "size_based_wrap" and size.min_num_params == 1000
    assert resolve_config(None, fsdp_args(version=2, auto_wrap_policy="NO_WRAP")).auto_wrap_policy == "no_wrap"


def test_full_state_dict_means_a_hugging_face_folder_at_the_end(caplog):
    config = resolve_config(None, fsdp_args(version=2, state_dict_type="FULL_STATE_DICT"))
    assert config.consolidate_on_train_end
    assert "state_dict_type=FULL_STATE_DICT" in caplog.text and "Hugging Face folder" in caplog.text


@pytest.mark.parametrize(
    "fsdp_config, named",
    [
        ({"version": 1}, "FSDP version 1 (FSDP1)"),
        ({"version": 2, "backward_prefetch": "BACKWARD_PRE"}, "backward_prefetch='BACKWARD_PRE'"),
        ({"version": 2, "use_orig_params": False}, "use_orig_params=False"),
        ({"version": 2, "sync_module_states": True}, "sync_module_states=True"),
        ({"version": 2, "forward_prefetch": True}, "forward_prefetch=True"),
        ({"version": 2, "xla": True}, "XLA FSDP"),
    ],
)
def test_what_cannot_carry_over_is_refused_by_name(fsdp_config, named):
    with pytest.raises(ValueError) as error:
        resolve_config(None, fsdp_args(**fsdp_config))
    assert named in str(error.value)


def test_an_unknown_key_is_a_named_warning(caplog):
    resolve_config(None, fsdp_args(version=2, activation_checkpointing_offload=True, my_typo=1))
    message = next(r.getMessage() for r in caplog.records if "Not carried over" in r.getMessage())
    assert "my_typo" in message and "activation_checkpointing_offload" in message


def test_accelerate_launch_flags_carry_over(monkeypatch):
    env = {
        **LAUNCH_DEFAULTS, "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer", "FSDP_RESHARD_AFTER_FORWARD": "false",
    }  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = resolve_config(None, TrainingArguments(output_dir="unused", report_to=[], use_cpu=True))
    assert config.fsdp_activation_checkpointing and config.reshard_after_forward == "false"
    assert config.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]


def test_the_launcher_defaults_of_fsdp1_options_are_not_refused_but_a_given_one_is(monkeypatch):
    for key, value in LAUNCH_DEFAULTS.items():
        monkeypatch.setenv(key, value)
    resolve_config(None, None)  # sync_module_states=true, use_orig_params=true, FULL_SHARD: what the launcher writes
    monkeypatch.setenv("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE")
    with pytest.raises(ValueError, match="backward_prefetch='BACKWARD_PRE'"):
        resolve_config(None, None)


def test_launch_mixed_precision_means_that_compute_dtype(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    assert resolve_config(None, args).param_dtype == "bfloat16"
    assert resolve_config(FSDP2Config(param_dtype="float32"), args).param_dtype == "float32"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # fp16 compute, with the gradient scaler (precision.py)
    assert resolve_config(None, None).param_dtype == "float16"


def test_launch_mixed_precision_fp8_means_float8_and_is_refused_by_name_without_fp8_tensor_cores(
    monkeypatch, caplog, tiny, tmp_path
):
    """Accelerate is told mixed_precision="no": an fp8 launch used to train in full precision without a word."""
    from transformers import AutoModelForCausalLM

    from hf_fsdp2 import FSDP2Trainer

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "TE")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    config = resolve_config(None, args)
    assert config.float8 and config.param_dtype == "bfloat16"
    carried = [r.getMessage() for r in caplog.records if "--mixed_precision fp8" in r.getMessage()]
    assert carried == ["Carried over from accelerate launch --mixed_precision fp8: float8=True, "
                       "param_dtype='bfloat16' (torchao's float8 in place of Accelerate's TE backend)."]  # fmt: skip
    with pytest.raises(ValueError, match=r"FSDP2Config\(float8=True\) computes the Linear layers with FP8 matmuls"):
        FSDP2Trainer(model=AutoModelForCausalLM.from_pretrained(tiny("llama")), args=args)


def test_without_fsdp_settings_the_config_is_left_as_it_is():
    config = FSDP2Config(reshard_after_forward="false")
    assert resolve_config(config, TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)) is config


def test_parallelism_config_replicas_become_hsdp_and_other_parallelisms_are_refused_by_name(monkeypatch):
    """TrainingArguments(parallelism_config=ParallelismConfig(...)): dp_replicate_size is HSDP; tp/cp/sp are named."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = SimpleNamespace(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    assert resolve_config(None, args).hsdp_replicate_size == 2
    assert args.parallelism_config is None  # Accelerate builds no mesh of its own
    assert resolve_config(None, args).hsdp_replicate_size == 2  # a second trainer on the same arguments
    for asked in (dict(cp_size=2), dict(sp_size=2)):
        args = SimpleNamespace(parallelism_config=ParallelismConfig(**asked))
        (name,) = asked
        with pytest.raises(
            ValueError, match=rf"{name}=2\)\): .*FSDP2Config\(sequence_parallel_size=2\).*remove {name}"
        ):
            resolve_config(None, args)
    with pytest.raises(ValueError, match=r"ParallelismConfig\(tp_size=2\)\): hf_fsdp2 shards parameters"):
        resolve_config(None, SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=2)))
    with pytest.raises(ValueError, match="disagrees with FSDP2Config"):
        resolve_config(
            FSDP2Config(hsdp_replicate_size=4),
            SimpleNamespace(parallelism_config=ParallelismConfig(dp_replicate_size=2)),
        )
    with pytest.raises(ValueError, match="dp_shard_size=3 x 1 replica"):
        resolve_config(None, SimpleNamespace(parallelism_config=ParallelismConfig(dp_shard_size=3)))
