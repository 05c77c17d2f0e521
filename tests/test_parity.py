"""N ranks vs one process: same seed, same global batch -> same losses, grad norms and final weights.

The reference is FSDP2Trainer as one plain process (no torchrun, world size 1); test_trainer.py checks
that this reference itself equals plain `transformers.Trainer`.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from tests.launch import load_result, run, run_batch

TOL = 1e-5
LAUNCH_TIMEOUT = 300  # seconds; a launch takes 5 to 90 s on 2 busy cores
MODELS = ["llama", "llama_tied", "qwen2", "gpt2"]


def out_dir(out_root, model: str, nproc: int, flags: tuple[str, ...], name: str = "") -> str:
    return os.path.join(str(out_root), name or f"{os.path.basename(model)}-{nproc}-{'-'.join(flags) or 'base'}")


def train(out_root, model: str, nproc: int, *flags: str, name: str = "") -> tuple[dict, dict]:
    """Return (result.json, final full weights) of a run, training it now unless `out_root` planned it."""
    out = out_dir(out_root, model, nproc, flags, name)
    failed = os.path.join(out, "launch_failed.txt")
    if os.path.exists(failed):  # planned, and its launch failed: its report, not a quiet second try
        with open(failed) as f:
            raise AssertionError(f.read())
    if not os.path.exists(os.path.join(out, "result.json")):
        run("train_worker.py", nproc, "--model", model, "--out", out, *flags)
    return load_result(out), torch.load(os.path.join(out, "weights.pt"))


def assert_same_run(got: tuple[dict, dict], ref: tuple[dict, dict], tol: float = TOL) -> None:
    """Losses, grad norms and every final weight agree within `tol`."""
    (result, weights), (ref_result, ref_weights) = got, ref
    assert len(result["losses"]) == len(ref_result["losses"]) > 0
    for step, (a, b) in enumerate(zip(result["losses"], ref_result["losses"], strict=True)):
        assert abs(a - b) <= tol, f"loss at step {step}: {a} vs {b}"
    for step, (a, b) in enumerate(zip(result["grad_norms"], ref_result["grad_norms"], strict=True)):
        assert abs(a - b) <= tol * max(1.0, abs(b)), f"grad_norm at step {step}: {a} vs {b}"
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        diff = (weights[key] - ref_weights[key]).abs().max().item()
        assert diff <= tol, f"{key} differs by {diff}"


VARIANTS = [
    ("--wrap", "no_wrap"),
    ("--wrap", "size_based_wrap"),
    ("--ac",),
    ("--loss-chunk", "7"),  # LM head + cross entropy over 7-token chunks (not a divisor of the rows)
    ("--reshard", "false"),
    ("--evaluate-first",),
    ("--user-optimizer", "--load", "object"),
    ("--user-optimizer", "--load", "from_pretrained"),
    ("--load", "from_pretrained"),
    ("--load", "object"),
    ("--load", "object_rank0"),
]


# Compiled blocks (inductor) with activation checkpointing, trained at 2 ranks against one eager process, then a
# gathered generate: the suite's one inductor-compiled FSDP2 training (its numbers equal eager ones within TOL).
GENERATE_WITH = ("--generate", "--ac", "--compile")


def planned_runs(tiny) -> list[tuple[str, int, tuple[str, ...], str]]:
    """Every run this module's tests compare: (model folder, ranks, worker flags, name)."""
    runs = []
    for model in MODELS:
        runs += [(tiny(model), 0, (), ""), (tiny(model), 2, (), ""), (tiny(model), 2, ("--defer",), "")]
    runs += [(tiny("llama_tied"), 2, flags, "") for flags in VARIANTS]
    runs += [
        (tiny("llama"), 4, ("--hsdp", "2", "--global-batch", "8", "--grad-accum", "1"), "hsdp"),
        (tiny("llama"), 0, ("--global-batch", "8", "--grad-accum", "1"), "ref8"),
        (tiny("llama"), 2, ("--bf16", "--data", "pattern", "--steps", "12", "--lr", "1e-2"), "bf16"),
        (tiny("llama"), 0, ("--task", "classify"), ""),
        (tiny("llama"), 2, ("--task", "classify"), ""),
        (tiny("llama"), 0, ("--generate",), "generate-1"),
        (tiny("llama"), 2, ("--generate",), "generate-2"),
        (tiny("llama"), 2, ("--generate", "--per-token-generate"), "generate-2-per-token"),
        (tiny("llama"), 0, GENERATE_WITH[:-1], "generate-1-with"),
        (tiny("llama"), 2, GENERATE_WITH, "generate-2-with"),
    ]
    return runs


@pytest.fixture(scope="module")
def out_root(tmp_path_factory, tiny):
    """Train every planned run before the tests compare them: one launch per world size, and the compiled runs in
    launches of their own, so a crash inside compiled code fails their two tests, not every test here."""
    root = tmp_path_factory.mktemp("parity")
    launches: dict[tuple[int, bool], list[list[str]]] = {}
    for model, nproc, flags, name in planned_runs(tiny):
        argv = ["--model", model, "--out", out_dir(root, model, nproc, flags, name), *flags]
        launches.setdefault((nproc, "--compile" in flags), []).append(argv)
    deadline = time.monotonic() + 800  # inside pytest's 900 s, which would end the whole module without a report
    for (nproc, _), runs in launches.items():
        try:
            timeout = int(min(LAUNCH_TIMEOUT, deadline - time.monotonic()))
            run_batch("train_worker.py", nproc, runs, str(root / "batches"), timeout=max(timeout, 1))
        except (AssertionError, subprocess.TimeoutExpired) as failure:  # these runs' tests fail with this report
            for argv in runs:
                if os.path.exists(os.path.join(argv[3], "result.json")):
                    continue  # finished before the failure: its tests compare it as usual
                os.makedirs(argv[3], exist_ok=True)
                with open(os.path.join(argv[3], "launch_failed.txt"), "w") as f:
                    f.write(f"{failure}\n{getattr(failure, 'stderr', None) or ''}")
    return root


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("defer", [False, True], ids=["reduce-every-step", "defer-sync"])
def test_two_ranks_match_one_process(out_root, tiny, model, defer):
    flags = ("--defer",) if defer else ()
    ref = train(out_root, tiny(model), 0)
    got = train(out_root, tiny(model), 2, *flags)
    assert got[0]["world"] == 2 and ref[0]["world"] == 1
    assert_same_run(got, ref)


def test_the_root_and_the_last_block_stay_gathered_into_backward(out_root, tiny):
    """The root (embedding, norm, head) and the last block are the first backward needs: resharding them after
    forward only adds an all-gather of each, every micro-batch. Every other block reshards."""
    result, _ = train(out_root, tiny("llama"), 2)
    flags = result["resharded_after_forward"]
    assert flags.pop("<root>") is False
    last = max(flags, key=lambda name: int(name.split(".")[-1]))
    assert flags.pop(last) is False and last == f"model.layers.{len(flags)}"
    assert flags and all(flags.values()), flags
    # Gathers per micro-batch: every unit in forward, then in backward only the blocks that resharded.
    micro_batches = len(result["steps"]) * 2
    assert result["all_gathers_in_training"] == micro_batches * (1 + (len(flags) + 1) + len(flags))


def test_deferred_sync_reduces_gradients_once_per_optimizer_step(out_root, tiny):
    """Deferring is exact either way, so parity alone cannot see it: count FSDP2's gradient reduce-scatters. Every
    unit reduces after each micro-batch's backward, or, deferred, only after the last one of each step."""
    every, _ = train(out_root, tiny("llama"), 2)
    deferred, _ = train(out_root, tiny("llama"), 2, "--defer")
    steps, units = len(every["steps"]), len(every["resharded_after_forward"])
    assert every["reduce_scatters_in_training"] == steps * 2 * units  # 2 micro-batches a step
    assert deferred["reduce_scatters_in_training"] == steps * units


def test_weights_changed_during_training(out_root, tiny):
    """Guard against a vacuous parity: training must move the weights well beyond the tolerance."""
    from transformers import AutoModelForCausalLM

    _, weights = train(out_root, tiny("llama"), 0)
    start = AutoModelForCausalLM.from_pretrained(tiny("llama")).state_dict()
    moved = max((weights[k] - start[k].float()).abs().max().item() for k in weights)
    assert moved > 1e-3


def test_hsdp_four_ranks_match_one_process(out_root, tiny):
    got = train(out_root, tiny("llama"), 4, "--hsdp", "2", "--global-batch", "8", "--grad-accum", "1", name="hsdp")
    ref8 = train(out_root, tiny("llama"), 0, "--global-batch", "8", "--grad-accum", "1", name="ref8")
    assert got[0]["world"] == 4
    assert_same_run(got, ref8)


@pytest.mark.parametrize("flags", VARIANTS, ids=lambda f: "-".join(x.strip("-") for x in f))
def test_variants_match_one_process(out_root, tiny, flags):
    """Wrap policies, activation checkpointing, a chunked loss, evaluate-before-train, a user optimizer and every
    load route change nothing about the numbers."""
    ref = train(out_root, tiny("llama_tied"), 0)
    got = train(out_root, tiny("llama_tied"), 2, *flags)
    assert_same_run(got, ref)
    assert got[0]["loss_chunked"] == ("--loss-chunk" in flags)


def test_bf16_trains_and_loss_falls(out_root, tiny):
    result, weights = train(
        out_root, tiny("llama"), 2, "--bf16", "--data", "pattern", "--steps", "12", "--lr", "1e-2", name="bf16"
    )
    losses = result["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
    # fp32 master weights: the trained weights are not bf16-rounded values.
    w = weights["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(w, w.to(torch.bfloat16).float())


def test_sequence_classification_trains_with_the_same_loss_on_two_ranks(out_root, tiny):
    """Its loss ignores num_items_in_batch; Trainer would multiply it by the world size if we let it."""
    ref = train(out_root, tiny("llama"), 0, "--task", "classify")
    got = train(out_root, tiny("llama"), 2, "--task", "classify")
    assert_same_run(got, ref)


def test_generate_on_the_sharded_model_matches_one_process(out_root, tiny):
    ref, _ = train(out_root, tiny("llama"), 0, "--generate", name="generate-1")
    got, _ = train(out_root, tiny("llama"), 2, "--generate", name="generate-2")
    assert len(got["generated"][0]) == 4 + 5
    assert got["generated"] == ref["generated"]
    # Gathered once per generate, not once per token: one all-gather per unit with parameters (root included).
    assert 0 < got["all_gathers_in_generate"] <= got["units"]
    # Unsynced while gathered: no all-reduce per token (the one left is the ranks' agreement that it fits).
    assert got["all_reduces_in_generate"] <= 1
    assert got["gathered_bytes"] == got["model_bytes"]  # what the fit check and the planner count: all of it
    assert got["resharded_after_generate"] == got["resharded_after_forward"]  # training's settings, put back
    assert got["sharded_after_generate"]
    per_token, _ = train(out_root, tiny("llama"), 2, "--generate", "--per-token-generate", name="generate-2-per-token")
    assert per_token["generated"] == ref["generated"]
    assert per_token["all_gathers_in_generate"] >= 5 * got["all_gathers_in_generate"]  # the blocks, every token
    assert per_token["all_reduces_in_generate"] >= 5  # synced_gpus: the ranks agree after every token


def test_compiled_blocks_train_as_one_eager_process_and_generate_eagerly(out_root, tiny):
    """Compiled blocks under activation checkpointing train at 2 ranks as one eager process does. Inside generate
    they run eagerly: decoding would recompile them per token shape and per layer (the KV cache's layer index is a
    guard) until dynamo's limit."""
    eager = train(out_root, tiny("llama"), 0, *GENERATE_WITH[:-1], name="generate-1-with")
    compiled = train(out_root, tiny("llama"), 2, *GENERATE_WITH, name="generate-2-with")
    assert_same_run(compiled, eager)
    got, ref = compiled[0], eager[0]
    assert got["generated"] == ref["generated"]
    assert got["compiled_calls_in_generate"] == 0
    assert 0 < got["all_gathers_in_generate"] <= got["units"]
    assert got["sharded_after_generate"]
    assert got["resharded_after_generate"] == got["resharded_after_forward"]
