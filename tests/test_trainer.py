"""FSDP2Trainer as a Trainer: same numbers as plain Trainer on one process, and clear refusals."""

from __future__ import annotations

import re
import weakref

import pytest
from transformers import TrainingArguments

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.distributed import _release_mesh_groups
from hf_fsdp2.trainer.sharding import validate_arguments, validate_training_args
from hf_fsdp2.trainer.step import _loss_uses_num_items, repoint_optimizer
from tests.launch import load_result, run, run_batch


def test_one_process_matches_plain_trainer(tmp_path, tiny):
    run("trainer_vs_plain.py", 0, tiny("llama_tied"), str(tmp_path))
    result = load_result(str(tmp_path))
    assert len(result["ours"]) == 4
    for step, (a, b) in enumerate(zip(result["ours"], result["plain"], strict=True)):
        assert abs(a - b) <= 1e-5, f"step {step}: {a} vs {b}"
    assert result["max_weight_diff"] <= 1e-5


def args(**kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, **kwargs)


def test_a_trainer_without_model_or_model_init_is_refused():
    with pytest.raises(ValueError, match="FSDP2Trainer needs `model`"):
        validate_arguments(None, {})
    validate_arguments(None, {"model_init": lambda: None})  # model_init alone is enough


def test_activation_checkpointing_twice_is_refused():
    with pytest.raises(ValueError, match="keep only FSDP2Config's"):
        validate_training_args(args(activation_checkpointing=True), FSDP2Config(fsdp_activation_checkpointing=True))


def test_an_optimizer_over_foreign_parameters_is_refused(tiny):
    import torch

    model = torch.nn.Linear(2, 2)
    other = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer parameter #0 \(shape \(3, 3\)\) is not a parameter"):
        repoint_optimizer(optimizer, {id(p): n for n, p in model.named_parameters()}, model)


def test_an_optimizer_is_repointed_by_name():
    import torch

    before = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(before.parameters(), lr=0.1)
    names = {id(p): n for n, p in before.named_parameters()}
    after = torch.nn.Linear(2, 2)  # stands in for the sharded model: new Parameter objects, same names
    repoint_optimizer(optimizer, names, after)
    assert optimizer.param_groups[0]["params"][0] is after.weight


def test_classification_losses_are_recognized_as_ignoring_num_items(tiny):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert not _loss_uses_num_items(AutoModelForSequenceClassification.from_pretrained(tiny("llama"), num_labels=3))
    assert _loss_uses_num_items(AutoModelForCausalLM.from_pretrained(tiny("llama")))


def test_without_use_cpu_a_cpu_machine_trains_on_the_cpu_process_group(tmp_path, tiny):
    """Accelerate sees torchrun's processes on a CPU only with use_cpu=True; FSDP2Trainer sets it by itself, so
    the same script trains exactly as with the flag (without it every rank would train on the same batches)."""
    import torch

    if torch.accelerator.is_available():
        pytest.skip("only a machine without accelerators has this trap")
    runs = {name: ["--model", tiny("llama"), "--out", str(tmp_path / name)] for name in ("without", "with")}
    runs["without"].append("--no-use-cpu")
    run_batch("train_worker.py", 2, list(runs.values()), str(tmp_path / "batches"))
    without, with_flag = load_result(str(tmp_path / "without")), load_result(str(tmp_path / "with"))
    assert without["world"] == 2 and without["losses"] == with_flag["losses"]
    assert without["use_cpu"] is True


def test_close_distributed_ends_the_group_and_its_threads_on_every_rank():
    proc = run("close_worker.py", 2, torchrun=True)  # fresh interpreters: what a real exit leaves running
    for rank in (0, 1):
        assert f"rank {rank}: sum 3, open after close False, gloo threads " in proc.stdout
        # destroy_process_group alone left all of them running (DTensor's caches and DDP kept the group)
        assert re.search(rf"rank {rank}: .*gloo threads [1-9]\d* before close, 0 after", proc.stdout), proc.stdout


def test_mesh_release_survives_weak_proxies_to_dead_objects():
    # torch.compile leaves weak proxies behind; isinstance on a dead one raises ReferenceError
    class Target:
        pass

    target = Target()
    proxy = weakref.proxy(target)
    del target
    _release_mesh_groups()
    with pytest.raises(ReferenceError):
        _ = proxy.anything  # the proxy really is dead, so the release above walked past it


def test_an_unchanged_trainer_script_ends_its_process_group_by_itself(tmp_path, tiny):
    # Fresh interpreters under torchrun: the exit handlers' order and a real interpreter exit are what is tested.
    proc = run("unchanged_script.py", 2, tiny("llama"), str(tmp_path), torchrun=True)  # raises unless exit code 0
    assert proc.stdout.count("at exit: process group open False") == 2, proc.stdout
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr


def test_a_rank_that_fails_after_training_does_not_hang_the_job(tmp_path, tiny):
    proc = run(
        "unchanged_script.py", 2, tiny("llama"), str(tmp_path), "fail", timeout=300, expect_ok=False, torchrun=True
    )
    assert proc.returncode != 0
    assert "rank 1 fails after training" in proc.stderr
