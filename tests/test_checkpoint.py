"""Sharded checkpoints: layout, crash safety, exact resume on the same and other world sizes, async save."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
from transformers.trainer_utils import get_last_checkpoint

from hf_fsdp2.checkpoint import read_metadata
from tests.launch import load_result, run

MODEL = "llama_tied"
STEPS = ("--save-steps", "2", "--steps", "6")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny) -> str:
    """An uninterrupted 2-rank run saving every 2 steps: the numbers every resume must reproduce."""
    out = str(tmp_path_factory.mktemp("reference"))
    run("train_worker.py", 2, "--model", tiny(MODEL), "--out", out, *STEPS)
    return out


def losses_by_step(out: str) -> dict[int, float]:
    result = load_result(out)
    return dict(zip(result["steps"], result["losses"], strict=True))


def resume(tmp_path, tiny, reference: str, nproc: int, checkpoint: str = "checkpoint-2", *flags: str) -> dict:
    """Copy one checkpoint of the reference run into a fresh folder and finish training from it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    shutil.copytree(os.path.join(reference, "run", checkpoint), run_dir / checkpoint)
    run(
        "train_worker.py",
        nproc,
        "--model",
        tiny(MODEL),
        "--out",
        str(tmp_path),
        "--run-dir",
        str(run_dir),
        "--resume",
        "last",
        *STEPS,
        *flags,
    )
    return losses_by_step(str(tmp_path))


def test_layout_is_accelerate_compatible_and_stores_tied_weights_once(reference):
    checkpoint = os.path.join(reference, "run", "checkpoint-4")
    for name in (
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
        "training_args.bin",
        "config.json",
        "pytorch_model_fsdp_0/.metadata",
        "optimizer_0/.metadata",
    ):
        assert os.path.isfile(os.path.join(checkpoint, name)), name
    # Each rank wrote its own part; no rank gathered the model.
    assert len(glob.glob(os.path.join(checkpoint, "pytorch_model_fsdp_0", "*.distcp"))) == 2
    keys = read_metadata(os.path.join(checkpoint, "pytorch_model_fsdp_0")).state_dict_metadata
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    assert sorted(os.listdir(os.path.join(reference, "run"))) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


@pytest.mark.parametrize(
    "nproc, extra, tol", [(2, (), 1e-6), (1, (), 1e-4), (4, ("--grad-accum", "1"), 1e-4)], ids=["2->2", "2->1", "2->4"]
)
def test_resume_continues_the_loss_curve(tmp_path, tiny, reference, nproc, extra, tol):
    expected = losses_by_step(reference)
    got = resume(tmp_path, tiny, reference, nproc, "checkpoint-2", *extra)
    for step in (3, 4, 5, 6):
        assert abs(got[step] - expected[step]) <= tol, f"step {step}: {got[step]} vs {expected[step]}"


def test_resume_from_four_ranks_on_two(tmp_path, tiny, reference):
    four = tmp_path / "four"
    run("train_worker.py", 4, "--model", tiny(MODEL), "--out", str(four), "--grad-accum", "1", *STEPS)
    got = resume(tmp_path / "two", tiny, str(four), 2, "checkpoint-4")
    expected = losses_by_step(reference)
    for step in (5, 6):
        assert abs(got[step] - expected[step]) <= 1e-4


def test_a_rank_killed_mid_save_leaves_only_complete_checkpoints(tmp_path, tiny, reference):
    out = str(tmp_path)
    proc = run(
        "train_worker.py", 2, "--model", tiny(MODEL), "--out", out, *STEPS, "--kill-in-save", "3", expect_ok=False
    )
    assert proc.returncode != 0
    run_dir = os.path.join(out, "run")
    assert get_last_checkpoint(run_dir) == os.path.join(run_dir, "checkpoint-2")
    assert not os.path.exists(os.path.join(run_dir, "checkpoint-4"))
    assert os.path.isdir(os.path.join(run_dir, ".checkpoint-4.incomplete")), "the partial save stays hidden"
    run("train_worker.py", 2, "--model", tiny(MODEL), "--out", out, *STEPS, "--resume", "last")
    expected, got = losses_by_step(reference), losses_by_step(out)
    for step in (3, 4, 5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6
    assert not os.path.exists(os.path.join(run_dir, ".checkpoint-4.incomplete")), "re-saving step 4 cleaned it"


def test_async_save_trains_identically_and_resumes_exactly(tmp_path, tiny, reference):
    out = tmp_path / "async"
    run("train_worker.py", 2, "--model", tiny(MODEL), "--out", str(out), *STEPS, "--async-save")
    assert losses_by_step(str(out)) == losses_by_step(reference)
    assert get_last_checkpoint(str(out / "run")).endswith("checkpoint-6")
    got = resume(tmp_path / "resumed", tiny, str(out), 2, "checkpoint-4")
    expected = losses_by_step(reference)
    for step in (5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6


def test_save_total_limit_rotates_checkpoints(tmp_path, tiny):
    run("train_worker.py", 2, "--model", tiny(MODEL), "--out", str(tmp_path), *STEPS, "--save-total-limit", "1")
    names = [n for n in os.listdir(tmp_path / "run") if n.startswith("checkpoint-")]
    assert names == ["checkpoint-6"]


def test_resuming_a_checkpoint_of_another_model_names_the_first_mismatch(tmp_path, tiny, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(reference, "run", "checkpoint-2"), run_dir / "checkpoint-2")
    proc = run(
        "train_worker.py",
        2,
        "--model",
        tiny("llama"),
        "--out",
        str(tmp_path),
        "--run-dir",
        str(run_dir),
        "--resume",
        "last",
        *STEPS,
        expect_ok=False,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "the checkpoint has no lm_head.weight: it was saved from another model" in proc.stdout + proc.stderr
