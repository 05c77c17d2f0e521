"""TRL GRPO (online RL) through FSDP2GRPOTrainer at 2 ranks (tests/workers/grpo_worker.py): the reward of a
learnable toy task rises, the per-token log-probs GRPO computes equal a one-process GRPOTrainer's, the reference
model (beta > 0) is sharded frozen, and LoRA trains with adapter-only checkpoints."""

from __future__ import annotations

import pytest

from tests.launch import load_runs, run

pytest.importorskip("trl", reason="the 'trl' extra")


@pytest.fixture(scope="module")
def grpo(tmp_path_factory, tiny) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("grpo")
    run("grpo_worker.py", 0, "plain", str(out), tiny("llama"), "logps", timeout=600)
    run("grpo_worker.py", 2, "fsdp2", str(out), tiny("llama"), timeout=900)
    return load_runs(out, "plain-1", "fsdp2-2")


def _ok(result: dict) -> dict:
    assert "error" not in result, result.get("traceback")
    return result


def test_grpo_at_two_ranks_raises_the_reward_of_a_learnable_task(grpo):
    full = _ok(grpo["fsdp2-2"]["full"])
    assert full["sharded"]
    rewards = full["rewards"]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.65 and last > 0.85 and last > first + 0.25, rewards  # random ~0.47, learned 1.0


def test_grpo_log_probs_of_fixed_completions_equal_one_process(grpo):
    ours, reference = _ok(grpo["fsdp2-2"]["logps"])["logps"], _ok(grpo["plain-1"]["logps"])["logps"]
    pairs = [pair for row, ref_row in zip(ours, reference, strict=True) for pair in zip(row, ref_row, strict=True)]
    diff = max(abs(a - b) for a, b in pairs)
    assert diff <= 1e-5


def test_grpo_reference_model_is_sharded_frozen(grpo):
    reference = _ok(grpo["fsdp2-2"]["reference"])
    assert reference["ref_sharded"] and reference["ref_trainable"] == 0
    assert reference["kl"][0] == 0.0 and reference["kl"][-1] > 0  # the policy moved away from the reference


def test_grpo_with_lora_trains_the_adapters_and_checkpoints_only_them(grpo):
    lora = _ok(grpo["fsdp2-2"]["lora"])
    assert lora["lora_b_abs_sum"] > 0
    assert "adapter_model.safetensors" in lora["files"] and "optimizer_0" in lora["files"]
    assert "pytorch_model_fsdp_0" not in lora["files"]


def test_rloo_through_the_mixin_raises_the_reward_too(grpo):
    rewards = _ok(grpo["fsdp2-2"]["rloo"])["rewards"]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards


def test_grpo_with_lora_resumes_with_auto_from_its_adapter_checkpoint(grpo):
    """Relaunched with resume_from_checkpoint='auto' after step 2: it goes on to step 4, and step 3 (its first) draws
    and scores the same completions as the uninterrupted run. Later steps draw other samples, in one-process TRL
    too (measured: plain GRPOTrainer resumed from checkpoint-2 differs from step 4 on as well)."""
    resume = _ok(grpo["fsdp2-2"]["resume"])
    assert resume["global_step"] == 4 and resume["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert resume["resumed"][:3] == resume["whole"][:3]


def test_online_dpo_through_the_mixin_raises_the_score_at_two_ranks(grpo):
    """trl.experimental's OnlineDPOTrainer in `class X(FSDP2Mixin, OnlineDPOTrainer)`: policy and reference sharded,
    the task learned as in one process."""
    run = _ok(grpo["fsdp2-2"]["online_dpo"])
    assert run["sharded"] and run["ref_sharded"]
    scores = run["scores"]
    assert len(scores) == 20
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert first < 0.65 and last > 0.85, scores  # random ~0.47, learned 1.0


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory, tiny) -> dict[str, dict]:
    """GRPO given a reward model's path and RLOO given the model object: one process with TRL's own classes, ours at
    world size 1 and at 2 ranks."""
    out = tmp_path_factory.mktemp("grpo_reward_models")
    scenarios = ["reward_model_grpo", "reward_model_rloo", "--reward-checkpoint", tiny("llama_reward")]
    run("grpo_worker.py", 0, "plain", str(out), tiny("llama"), *scenarios, timeout=600)
    run("grpo_worker.py", 0, "fsdp2", str(out), tiny("llama"), *scenarios, timeout=600)
    run("grpo_worker.py", 2, "fsdp2", str(out), tiny("llama"), *scenarios, timeout=600)
    return load_runs(out, "plain-1", "fsdp2-1", "fsdp2-2")


@pytest.mark.parametrize("run_name", ["fsdp2-1", "fsdp2-2"])
@pytest.mark.parametrize("scenario", ["reward_model_grpo", "reward_model_rloo"])
def test_reward_models_score_what_trl_scores(reward_models, scenario, run_name):
    """TRL scores reward models under torch.inference_mode(): sharded, ours score the same 8 completions."""
    ours, theirs = _ok(reward_models[run_name][scenario]), _ok(reward_models["plain-1"][scenario])
    assert ours["fsdp2_only"] == {"sharded": True, "trainable": 0}
    assert len(ours["scores"]) == 8 and any(row[0] != 0 for row in theirs["scores"])
    # fp32; rows are scored whole on every rank from the same gathered weights, so only kernel order may differ.
    pairs = [
        pair for row, ref in zip(ours["scores"], theirs["scores"], strict=True) for pair in zip(row, ref, strict=True)
    ]
    diff = max(abs(a - b) for a, b in pairs)
    assert diff <= 1e-6
    assert all(r == r for r in ours["step_rewards"])  # TRL's own training step scored (not NaN) with the model
