"""The key checks on CUDA with nccl and bf16. Skipped unless at least two CUDA devices are present."""

from __future__ import annotations

import os

import pytest
import torch

from tests.launch import load_result, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_two_gpus_bf16_track_one_gpu(tmp_path, tiny):
    """bf16 compute is not bitwise reproducible across world sizes; losses must still agree closely."""
    common = ("--model", tiny("llama"), "--bf16", "--data", "pattern", "--steps", "8", "--lr", "1e-2")
    run("train_worker.py", 0, *common, "--out", str(tmp_path / "one"))
    run("train_worker.py", 2, *common, "--out", str(tmp_path / "two"))
    one, two = load_result(str(tmp_path / "one")), load_result(str(tmp_path / "two"))
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True)) < 2e-2
    assert two["losses"][-1] < two["losses"][0]


def test_two_gpus_load_exactly_and_resume(tmp_path, tiny):
    out = tmp_path / "run"
    run("train_worker.py", 2, "--model", tiny("llama_tied"), "--out", str(out), "--save-steps", "2", "--steps", "4")
    run(
        "train_worker.py",
        2,
        "--model",
        tiny("llama_tied"),
        "--out",
        str(out),
        "--save-steps",
        "2",
        "--steps",
        "4",
        "--resume",
        os.path.join(out, "run", "checkpoint-2"),
    )
    assert load_result(str(out))["steps"][-1] == 4
