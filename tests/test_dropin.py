"""Drop-in: ordinary Trainer scripts with `Trainer` swapped for `FSDP2Trainer` give the same numbers.

One launch per setting runs every scenario of tests/workers/dropin_worker.py: plain `Trainer` as one
process (the reference), `FSDP2Trainer` as one process and on 2 ranks. Each test then compares one
scenario: losses, gathered weights, exported files, within 1e-5 (fp32). The worker never calls
close_distributed(), like a user's script: the 2-rank launch must still exit 0.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import load_runs, run

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def dropin(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict[str, Any]]:
    """Results of every scenario: {"plain-1": ..., "fsdp2-1": ..., "fsdp2-2": ...}."""
    out = tmp_path_factory.mktemp("dropin")
    models = (tiny("llama"), tiny("gpt2"))
    for name in ("qwen3_moe", "mixtral", "llama_bf16"):  # read by path beside llama
        tiny(name)
    for mode, nproc in (("plain", 0), ("fsdp2", 0), ("fsdp2", 2)):
        run("dropin_worker.py", nproc, mode, str(out), *models, timeout=900)
    return load_runs(out, "plain-1", "fsdp2-1", "fsdp2-2")


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Every place where two results disagree (numbers beyond TOLERANCE, other values at all)."""
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return [f"{path}: keys differ: {sorted(set(expected) ^ set(actual))[:5]}"]
        return [d for key in expected for d in differences(expected[key], actual[key], f"{path}.{key}")]
    if isinstance(expected, list):
        if len(expected) != len(actual):
            return [f"{path}: {len(expected)} items, {len(actual)} now"]
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in differences(e, a, f"{path}[{i}]")
        ]
    if isinstance(expected, float) or isinstance(actual, float):
        return [f"{path}: {expected} vs {actual}"] if abs(expected - actual) > TOLERANCE else []
    return [f"{path}: {expected!r} vs {actual!r}"] if expected != actual else []


SCENARIOS = [
    "plain_module",
    "scalar_resume",
    "custom_pretrained",
    "second_trainer",
    "model_init",
    "best_model_and_early_stopping",
    "predict",
    "custom_optimizer",
    "iterable_dataset",
    "gradient_checkpointing",
    "subclass",
    "seq2seq_own_loss",
    "hyperparameter_search",
    "torch_compile",
    "moe_qwen3",
    "moe_mixtral",
    "lora_new_tokens",
]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fsdp2_trainer_matches_plain_trainer(dropin, scenario, world):
    skip = ("per_rank",)
    reference = {k: v for k, v in dropin["plain-1"][scenario].items() if k not in skip}
    ours = {k: v for k, v in dropin[f"fsdp2-{world}"][scenario].items() if k not in skip}
    assert "error" not in reference, reference.get("traceback")
    assert "error" not in ours, ours.get("traceback")
    found = differences(reference, ours, scenario)
    assert not found, "\n".join(found[:10])


def test_the_scenarios_check_what_they_claim(dropin):
    plain = dropin["plain-1"]
    assert len(plain["plain_module"]["losses"]) == 4 and "scale" in plain["plain_module"]["exported"]
    resumed = plain["scalar_resume"]  # the resumed run's history starts with the checkpoint's two steps
    assert resumed["resumed"][2:] == pytest.approx(resumed["losses"][2:], abs=1e-6)
    assert "temperature" in plain["custom_pretrained"]["weights"]
    assert plain["model_init"]["again"] == plain["model_init"]["losses"]
    best = plain["best_model_and_early_stopping"]
    assert best["global_step"] < 12, "early stopping never stopped: the scenario does not exercise it"
    assert best["best"] in best["checkpoints"] and len(best["checkpoints"]) <= 3
    assert best["eval_after_best"] == pytest.approx(min(best["evals"]), abs=1e-6)


def test_saved_configs_are_what_save_pretrained_writes(dropin):
    """Every exported and checkpointed config.json equals plain Trainer's (written by save_pretrained in one
    process): fully_shard's generated FSDP<Class> must not reach `architectures`, which tools load by name."""
    import transformers

    plain, ours = dropin["plain-1"], dropin["fsdp2-2"]
    configs = {
        "custom_pretrained": plain["custom_pretrained"]["configs"],
        "seq2seq": plain["seq2seq_own_loss"]["configs"],
        **{f"best_model/{c}": v for c, v in plain["best_model_and_early_stopping"]["configs"].items()},
    }
    assert len(configs) >= 4 and all("config.json" in c for c in configs.values())
    assert ours["custom_pretrained"]["configs"] == configs["custom_pretrained"]
    assert ours["seq2seq_own_loss"]["configs"] == configs["seq2seq"]
    assert ours["best_model_and_early_stopping"]["configs"] == plain["best_model_and_early_stopping"]["configs"]
    assert configs["custom_pretrained"]["config.json"]["architectures"] == ["TinyMLP"]
    for name, saved in configs.items():
        if name != "custom_pretrained":
            assert all(hasattr(transformers, arch) for arch in saved["config.json"]["architectures"]), name


def test_a_bf16_checkpoint_with_bf16_trains_fp32_masters_and_exports_bf16(dropin):
    """Plain Trainer trains the bf16 weights themselves; FSDP2Trainer keeps fp32 masters and computes in bf16 (the
    better numerics), so the losses agree only to bf16 rounding; the export is in the checkpoint's dtype."""
    plain, one, two = (dropin[run]["bf16_checkpoint"] for run in ("plain-1", "fsdp2-1", "fsdp2-2"))
    for result in (plain, one, two):
        assert "error" not in result, result.get("traceback")
    assert plain["trained_dtypes"] == ["torch.bfloat16"]
    assert one["trained_dtypes"] == two["trained_dtypes"] == ["torch.float32"]
    assert one["exported_dtypes"] == two["exported_dtypes"] == plain["exported_dtypes"] == ["BF16"]
    assert one["losses"] == pytest.approx(plain["losses"], abs=2e-2)
    assert two["losses"] == pytest.approx(one["losses"], abs=2e-2)


def test_a_second_trainer_with_other_settings_or_a_foreign_shard_is_refused(dropin):
    messages = dropin["fsdp2-2"]["refusals"]
    assert "param_dtype: 'None' then, 'torch.bfloat16' now" in messages["bf16_now"]
    assert "reshard_after_forward: 'true' then, 'false' now" in messages["other_units"]
    assert "already sharded with fully_shard outside hf_fsdp2" in messages["foreign"]
    assert "no module matched transformer_layer_cls_to_wrap=['NoSuchBlock']" in messages["unknown_block"]


def test_a_0_dim_parameter_of_a_real_model_trains_and_stays_equal_on_every_rank(dropin):
    """CLIP's logit_scale. Its contrastive loss depends on each rank's batch (as under DDP), so only one
    process can match plain Trainer exactly; on 2 ranks the scalar must move and agree across ranks."""
    found = differences(dropin["plain-1"]["clip"], dropin["fsdp2-1"]["clip"], "clip")
    assert not found, "\n".join(found[:10])
    two = dropin["fsdp2-2"]["clip"]
    assert "error" not in two, two.get("traceback")
    scale = two["per_rank"]["logit_scale"]
    assert len(scale) == 2 and scale[0] == scale[1]
    assert abs(scale[0] - 2.6592) > 1e-3, "logit_scale never moved from CLIP's initial log(1/0.07)"
