"""Sharded modules whose first forward runs under torch.inference_mode() (TRL's reward models; evaluation callbacks):
plain `fully_shard` breaks, at world size 1 at once and at 2 ranks in the next training step; with the switch
`hf_fsdp2.sharding.inference_mode` puts on every unit, scores equal the unsharded model's and training goes on
(tests/workers/inference_mode_worker.py, gloo)."""

from __future__ import annotations

import pytest

from tests.launch import load_runs, run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("inference_mode")
    run("inference_mode_worker.py", 0, str(out), timeout=300)
    run("inference_mode_worker.py", 2, str(out), timeout=300)
    return load_runs(out, "1", "2")


INFERENCE_TENSOR_ERRORS = (
    "Inference tensors do not track version counter.",
    "Inplace update to inference tensor outside InferenceMode",
)


def test_plain_fully_shard_breaks_under_inference_mode(runs):
    """The cause the switch exists for: FSDP2's lazily allocated gather buffers become inference tensors."""
    # Either of torch's two inference-tensor errors: at one rank torch 2.13 raises the first, torch 2.15 the second
    # (seen in the 2.15 x transformers 5.23 run of 2026-11-27); 2 ranks raise the second on both.
    assert runs["1"]["without_switch"]["error"].startswith(INFERENCE_TENSOR_ERRORS)
    at_two = runs["2"]["without_switch"]
    assert at_two["max_diff"] == 0.0  # the inference forwards themselves work at 2 ranks...
    assert at_two["error"].startswith("Inplace update to inference tensor outside InferenceMode")  # ...training not


@pytest.mark.parametrize("world", ["1", "2"])
def test_switch_scores_exactly_and_training_goes_on(runs, world):
    result = runs[world]["with_switch"]
    assert "error" not in result, result
    assert result["still_inference_mode"]  # the caller's mode is back after each forward
    assert result["max_diff"] == 0.0  # fp32, the same gathered weights and kernels as the unsharded twin
    assert result["grad_norm"] == pytest.approx(result["expected_grad_norm"], rel=1e-6)
    bf16 = runs[world]["with_switch_bf16"]
    assert "error" not in bf16, bf16
    assert bf16["max_diff"] < 1e-2  # bf16 compute against the fp32 twin: a few bf16 ulps of outputs ~0.5


@pytest.mark.parametrize("world", ["1", "2"])
def test_compiled_units_keep_the_switch_out_of_their_graphs(runs, world):
    """FSDP2Config(compile=True) compiles each unit with its hooks: the switch runs eagerly, as FSDP2's own hooks do,
    so no block's graph breaks on it (it did: torch.is_inference_mode_enabled() cannot be traced), and a compiled unit
    called first under inference mode still leaves it."""
    result = runs[world]["compiled"]
    assert "error" not in result, result
    # torch 2.15 reports every call of a compiler-disabled function inside a compiled unit as a break, FSDP2's own
    # hooks' too (measured on 2.15 with our hooks removed: "Call to `torch._dynamo.disable()`" twice); torch 2.13
    # reports none. What must not appear is a break inside the switch's body (it was is_inference_mode_enabled()).
    assert all("disable" in reason for reason in result["graph_breaks"]), result["graph_breaks"]
    assert result["still_inference_mode"] and result["max_diff"] == 0.0
    assert result["grad_norm"] == pytest.approx(result["expected_grad_norm"], rel=1e-6)


@pytest.mark.parametrize("world", ["1", "2"])
def test_gathered_under_inference_mode(runs, world):
    result = runs[world]["gathered"]
    assert result == {"max_diff": 0.0, "trained": True}
