"""The TrainingArguments GPU users switch on (issue 61), at 2 ranks against one process: fp16 with a gradient scaler
every rank agrees on (and resumes), auto_find_batch_size after an out-of-memory error on one rank, bf16/fp16 full
evaluation that leaves the fp32 masters alone; Liger refused by name where it cannot run.

Plain `Trainer(fp16=True)` is no reference on this machine: on the CPU Accelerate builds no scaler and no autocast,
so it trains in fp32 without a word. The fp16 reference is FSDP2Trainer in one process.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from torch.distributed.fsdp import FSDPModule

from hf_fsdp2 import FSDP2Config
from tests.launch import load_runs, run

# torch 2.11 has no FSDPModule.reset_iter_state: auto_find_batch_size is refused there (its own test below).
RETRIES = hasattr(FSDPModule, "reset_iter_state")
needs_retries = pytest.mark.skipif(not RETRIES, reason="auto_find_batch_size needs FSDPModule.reset_iter_state")
ONE_PROCESS = ["fp16", "fp16_accumulated", "fp16_clipped", "fp32"] + (["oom_forward_everywhere"] if RETRIES else [])
TWO_RANKS = ["fp16", "overflow", "resume", "eval_fp32", "eval_bf16", "eval_fp16", "eval_never"]
# In a launch of their own, with a shorter timeout: a broken agreement hangs the ranks (until the meeting's timeout
# on the rank that ran out of memory, then in the collectives of the scenarios after it).
TWO_RANKS_OOM = ["oom_optimizer", "oom_forward_everywhere"]

# fp16's noise floor, measured (2026-11-28, this machine): the same one-process run with the global batch of 4 rows in
# one micro-batch or in two differs by 2.0e-5 in the losses and 1.8e-4 in the weights over 4 steps (each forward
# rounds other rows together in fp16). Two ranks differ from one process by exactly that (they compute the two
# micro-batches' rows). These runs do not clip (a norm summed in another order, magnified by fp16's rounding of the
# weights); the clipped run is checked against fp32. The tolerance is 5x the floor.
FP16_TOLERANCE = {"losses": 1e-4, "weights": 1e-3}
# Full evaluation in bf16/fp16 against fp32 evaluation of the same weights (6 evaluations over a run), measured
# 2026-11-28: bf16 differs by 0.9e-4 to 2.5e-4, fp16 by 1.4e-6 to 1.5e-5. Close: within 8x the largest measured;
# different: the largest difference is over a fifth of the measured one (a run that stayed in fp32 differs by 0).
FULL_EVAL = {"eval_bf16": {"close": 2e-3, "differs": 5e-5}, "eval_fp16": {"close": 2e-4, "differs": 3e-6}}


@pytest.fixture(scope="module")
def switches(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("switches")
    run("switches_worker.py", 0, str(out), tiny("llama"), *ONE_PROCESS, timeout=600)
    run("switches_worker.py", 2, str(out), tiny("llama"), *TWO_RANKS, timeout=600)
    return checked(load_runs(out, "switches-1", "switches-2"))


@pytest.fixture(scope="module")
def oom(tmp_path_factory: pytest.TempPathFactory, tiny, switches) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("oom")
    two_ranks = run("switches_worker.py", 2, str(out), tiny("llama"), *TWO_RANKS_OOM, timeout=240)
    runs = checked(load_runs(out, "switches-2"))
    return {"switches-1": switches["switches-1"], **runs, "log-2": two_ranks.stdout + two_ranks.stderr}


def checked(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The runs, once no scenario in them recorded an error."""
    for name, results in runs.items():
        for scenario, found in results.items():
            assert "error" not in found, f"{name} {scenario}: {found.get('traceback')}"
    return runs


def largest_difference(expected: dict[str, Any], actual: dict[str, Any], key: str) -> float:
    """The largest elementwise difference of `key` (losses: a list; weights: a dict of lists) between two runs."""
    first, second = expected[key], actual[key]
    if isinstance(first, dict):
        assert first.keys() == second.keys()
        return max(largest_difference({"x": first[k]}, {"x": second[k]}, "x") for k in first)
    assert len(first) == len(second)
    return max(abs(a - b) for a, b in zip(first, second, strict=True))


def test_fp16_at_two_ranks_equals_one_process_computing_the_same_micro_batches(switches):
    # Each rank's forward covers the rows one process computes in each of its two micro-batches; the two fp16
    # gradients then meet in one fp32 sum either way (and the loss scale is a power of two): equal by construction.
    ours, reference = switches["switches-2"]["fp16"], switches["switches-1"]["fp16_accumulated"]
    assert ours["losses"] == reference["losses"]
    assert ours["weights"] == reference["weights"]


@pytest.mark.parametrize("key", ["losses", "weights"])
def test_fp16_at_two_ranks_matches_one_process_within_fp16_noise(switches, key):
    one = switches["switches-1"]
    floor = largest_difference(one["fp16"], one["fp16_accumulated"], key)
    assert 0 < floor < FP16_TOLERANCE[key] / 2, f"fp16's noise floor moved ({floor:.2e}): re-measure the tolerance"
    found = largest_difference(one["fp16"], switches["switches-2"]["fp16"], key)
    assert found <= FP16_TOLERANCE[key], f"{key}: {found:.2e} from one process (noise floor {floor:.2e})"


def test_fp16_computes_in_fp16_on_fp32_masters_and_clips_the_unscaled_gradients(switches):
    fp16, fp32 = switches["switches-1"]["fp16_clipped"], switches["switches-1"]["fp32"]
    assert switches["switches-2"]["fp16"]["master_dtypes"] == ["torch.float32"]
    assert abs(fp16["losses"][0] - fp32["losses"][0]) > 1e-6, "the first forward did not compute in fp16"
    for key in ("losses", "weights"):
        assert largest_difference(fp32, fp16, key) <= 2 * FP16_TOLERANCE[key]
    # The logged norm is the unscaled gradients' (a norm taken before unscaling would be 65536 times larger, and
    # clipping to it would all but stop training).
    for ours, reference in zip(fp16["norms"], fp32["norms"], strict=True):
        assert abs(ours - reference) <= 1e-2 * reference
    assert fp16["scales"] == [65536.0] * 4  # nothing overflowed: torch's initial scale, kept


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(switches):
    ranks = switches["switches-2"]["overflow"]["ranks"]
    for rank, seen in enumerate(ranks):
        # step 2: rank 1 alone had an inf in its shard of the embedding's gradient
        assert seen["changed"] == [True, False, True, True], f"rank {rank}'s shards: {seen['changed']}"
        assert seen["skipped"] == [False, True, False, False], f"rank {rank}"
        assert seen["scales"] == [65536.0, 32768.0, 32768.0, 32768.0], f"rank {rank}'s scale: {seen['scales']}"


def test_the_scaler_state_resumes_exactly(switches):
    runs = switches["switches-2"]["resume"]
    assert runs["has_scaler_file"], "checkpoint-4 has no scaler.pt"
    whole, resumed = runs["whole"], runs["resumed"]
    assert True in runs["skipped"][4:], "no overflow after the checkpoint: the scaler's state would not matter"
    assert resumed["losses"] == whole["losses"]
    assert resumed["scales"] == whole["scales"][4:]
    assert resumed["weights"] == whole["weights"]
    # The same checkpoint without its scaler.pt resumes at the initial scale, and its curve leaves the whole run's.
    assert runs["without_scaler"]["losses"] != whole["losses"]


@pytest.mark.parametrize(
    "world, scenario, stage",
    [
        (2, "oom_optimizer", "clipping or the optimizer step"),  # rank 1 alone
        (2, "oom_forward_everywhere", "forward or backward"),  # both ranks, the same block
        (1, "oom_forward_everywhere", "forward or backward"),
    ],
)
@needs_retries
def test_an_out_of_memory_error_makes_every_rank_retry_with_the_same_smaller_batch(oom, world, scenario, stage):
    found = oom[f"switches-{world}"][scenario]
    # from 2 rows per rank, Accelerate's retry takes int(2 * 0.9) = 1, on every rank, and the run goes on
    assert found["ranks"] == [{"batch": 1, "state": 1, "saved": 1}] * world  # saved: checkpoint-2's trainer_state
    assert found["steps"] == 4 and len(found["losses"]) == 4
    if world == 2:
        line = f"rank 1 ran out of memory at step 2 ({stage}); every rank now trains with per_device_train_batch_size=1"
        assert line in oom["log-2"]


@needs_retries
def test_an_out_of_memory_error_on_one_rank_inside_the_collectives_fails_instead_of_hanging(tmp_path, tiny):
    # Rank 1 alone fails in a forward: rank 0 waits in the next all-gather, which rank 1 never joins. Rank 1 gives up
    # at the meeting after its timeout (3 s here, 5 min by default) with the fix in its message; the launcher, as
    # torchrun would, then stops rank 0.
    started = time.monotonic()
    proc = run("switches_worker.py", 2, str(tmp_path), tiny("llama"), "oom_forward_one_rank", expect_ok=False)
    assert proc.returncode != 0
    assert time.monotonic() - started < 120
    assert "rank 1 ran out of memory at step 2 (forward or backward), and the other ranks did not reach" in proc.stderr
    assert "Lower per_device_train_batch_size" in proc.stderr


@pytest.mark.parametrize("scenario", list(FULL_EVAL))
def test_full_evaluation_computes_in_its_dtype(switches, scenario):
    ours, fp32 = switches["switches-2"][scenario]["evals"], switches["switches-2"]["eval_fp32"]["evals"]
    assert len(ours) == len(fp32) == 6  # before training, after each of 4 steps, after training
    differences = [abs(a - b) for a, b in zip(ours, fp32, strict=True)]
    assert max(differences) <= FULL_EVAL[scenario]["close"], differences
    assert max(differences) >= FULL_EVAL[scenario]["differs"], f"{scenario} evaluated as fp32 does: {differences}"


@pytest.mark.parametrize("scenario", ["eval_fp32", *FULL_EVAL])
def test_training_after_full_evaluation_equals_training_never_evaluated(switches, scenario):
    ours, never = switches["switches-2"][scenario], switches["switches-2"]["eval_never"]
    assert ours["master_dtypes"] == ["torch.float32"]
    assert ours["losses"] == never["losses"]
    assert ours["weights"] == never["weights"]


# Liger needs a CUDA device: here only its refusals run (its kernels: the GPU check's part, when a GPU is lent).


def test_auto_find_batch_size_is_refused_by_name_where_torch_cannot_reset_fsdps_step(monkeypatch):
    """torch 2.11's FSDPModule has no reset_iter_state: a retried step would start from a half-finished one."""
    from transformers import TrainingArguments

    from hf_fsdp2.trainer.batch_size import check_batch_size_search

    args = TrainingArguments("out", auto_find_batch_size=True, report_to=[], use_cpu=True)
    monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)
    with pytest.raises(ValueError, match=r"auto_find_batch_size=True needs torch's FSDPModule.reset_iter_state"):
        check_batch_size_search(args)
    check_batch_size_search(TrainingArguments("out", report_to=[], use_cpu=True))  # off: nothing to refuse


def test_liger_is_refused_by_name_on_a_machine_without_a_cuda_device():
    from transformers import TrainingArguments

    from hf_fsdp2.trainer.sharding import validate_training_args

    args = TrainingArguments(output_dir="unused", use_liger_kernel=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"use_liger_kernel=True.*Triton's GPU backend.*no CUDA device"):
        validate_training_args(args, FSDP2Config())


def liger_model(case: str) -> tuple[Any, list[Any], FSDP2Config]:
    """A tiny Llama set up as `case`; its units under the case's FSDP2Config."""
    from peft import LoraConfig, get_peft_model

    from hf_fsdp2.loading.facts import describe
    from hf_fsdp2.sharding.units import select_units
    from tests.tiny_models import llama

    model, config = llama(tied=case == "tied"), FSDP2Config()
    if case == "lora_head":
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    elif case == "saved_head":
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    elif case == "lora":
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    elif case == "head_unit":
        config = FSDP2Config(auto_wrap_policy=lambda module: type(module).__name__ in ("LlamaDecoderLayer", "Linear"))
    elif case == "chunked":
        config = FSDP2Config(loss_chunk_size=8)
    describe(model)
    return model, select_units(model, config), config


@pytest.mark.parametrize(
    "case, message",
    [
        ("lora_head", "the LM head is a peft.tuners.lora.layer.Linear (LoRA on lm_head"),
        ("saved_head", "the LM head is a peft.utils.other.ModulesToSaveWrapper"),
        ("head_unit", "the LM head is inside the FSDP unit 'lm_head', not the root"),
        ("chunked", "with FSDP2Config(loss_chunk_size=8)"),
    ],
)
def test_liger_fused_loss_is_refused_where_it_would_not_read_the_whole_head(case, message):
    from hf_fsdp2.sharding.liger import check_liger_model

    model, units, config = liger_model(case)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_liger_model(model, units, None, config)
    # Liger's layer kernels alone leave the head and the loss to the model: nothing to refuse.
    check_liger_model(model, units, {"fused_linear_cross_entropy": False}, config)


@pytest.mark.parametrize("case", ["untied", "tied", "lora"])
def test_liger_fused_loss_is_accepted_with_the_head_in_the_root_unit(case):
    from hf_fsdp2.sharding.liger import check_liger_model

    model, units, config = liger_model(case)
    check_liger_model(model, units, None, config)
