"""TRL through hf_fsdp2: SFT (full and peft_config LoRA) and DPO (full and LoRA) on 2 ranks give the per-step
losses and weights of plain one-process TRL (fp32); SFTConfig's own defaults (bf16, gradient checkpointing)
train; DPO's reference model is sharded and frozen."""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import load_runs, run
from tests.test_dropin import differences

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl")
    for mode, nproc in (("plain", 0), ("fsdp2", 2)):
        run("trl_worker.py", nproc, mode, str(out), tiny("llama"), timeout=900)
    return load_runs(out, "plain-1", "fsdp2-2")


@pytest.mark.parametrize("scenario", ["sft_full", "sft_lora", "sft_lora_object", "dpo_full", "dpo_lora"])
def test_two_ranks_match_plain_one_process_trl(trl_runs, scenario):
    # Checkpoint layouts differ on purpose (DCP optimizer_0/, no model card): checked in the next test.
    skip = ("fsdp2_only", "checkpoint_files")
    reference = {k: v for k, v in trl_runs["plain-1"][scenario].items() if k not in skip}
    ours = {k: v for k, v in trl_runs["fsdp2-2"][scenario].items() if k not in skip}
    assert "error" not in ours, ours.get("traceback")
    found = differences(reference, ours, scenario)
    assert not found, "\n".join(found[:10])


def test_peft_config_checkpoints_are_adapter_only_and_resume_exactly(trl_runs):
    lora = trl_runs["fsdp2-2"]["sft_lora"]
    assert "adapter_model.safetensors" in lora["checkpoint_files"] and "adapter_config.json" in lora["checkpoint_files"]
    assert "pytorch_model_fsdp_0" not in lora["checkpoint_files"], "no frozen base weight in a LoRA checkpoint"
    assert lora["resumed"] == pytest.approx(lora["losses"][2:], abs=1e-5)
    assert lora["exported"] and all("lora_" in key for key in lora["exported"])
    # merge_adapters_on_save on a peft_config model equals peft's merge_and_unload of the adapter export
    assert lora["fsdp2_only"]["merged_vs_peft"] <= 1e-6


def test_sft_config_defaults_train_on_two_ranks(trl_runs):
    losses = trl_runs["fsdp2-2"]["sft_defaults"]["bf16_losses"]
    plain = trl_runs["plain-1"]["sft_defaults"]["bf16_losses"]
    assert len(losses) == 4
    # bf16 autocast (plain) and FSDP2's bf16 MixedPrecisionPolicy round differently: close, not equal.
    assert losses == pytest.approx(plain, abs=2e-2)


def test_dpo_reference_model_is_sharded_frozen_and_not_optimized(trl_runs):
    facts = trl_runs["fsdp2-2"]["dpo_full"]["fsdp2_only"]
    assert facts["ref_sharded"] and facts["ref_trainable"] == 0
    assert facts["optimizer_params"] == facts["policy_params"], "the optimizer holds the policy's parameters only"
