"""A script written for Trainer + Accelerate's FSDP2 plugin trains with FSDP2Trainer as one process would, its
FSDP settings carried over (not ignored): from `TrainingArguments(fsdp_config=...)` and from a real
`accelerate launch --use_fsdp ...` at 2 ranks (tests/workers/accelerate_settings_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import ROOT, WORKERS, run
from tests.test_dropin import differences

LAUNCH_FLAGS = [
    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
    "--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--fsdp_activation_checkpointing", "true",
    "--fsdp_reshard_after_forward", "false", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny) -> dict[str, dict]:
    out = str(tmp_path_factory.mktemp("accelerate_settings"))
    model = tiny("llama")
    run("accelerate_settings_worker.py", 0, "plain", model, out)
    run("accelerate_settings_worker.py", 2, "fsdp_config", model, out)
    run("accelerate_settings_worker.py", 2, "ours", model, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *LAUNCH_FLAGS]
    command += [os.path.join(WORKERS, "accelerate_settings_worker.py"), "launch", model, out]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = {}
    for mode in ("plain", "fsdp_config", "ours", "launch"):
        with open(os.path.join(out, f"{mode}.json")) as f:
            results[mode] = json.load(f)
    return results


@pytest.mark.parametrize("mode", ["fsdp_config", "launch"])
def test_carried_settings_train_as_one_process(runs, mode):
    found = differences(runs["plain"], {k: runs[mode][k] for k in ("losses", "weights")})
    assert not found, "\n".join(found[:10])


@pytest.mark.parametrize("mode", ["fsdp_config", "launch"])
def test_carried_settings_are_applied_as_fsdp2_config_applies_them(runs, mode):
    """Activation checkpointing really on (every decoder layer recomputes in backward), units kept gathered."""
    assert runs[mode]["config"] == {"fsdp_activation_checkpointing": True, "reshard_after_forward": "false"}
    assert runs[mode]["checkpointed"] == runs["ours"]["checkpointed"] and runs[mode]["wrappers"] == []
    assert len(runs["ours"]["checkpointed"]) == 2 and all(".layers." in n for n in runs["ours"]["checkpointed"])
