"""Surviving failures with real processes: a SIGKILLed rank under `torchrun --max-restarts`, a SIGTERM to
torchrun's agent or to one rank, each ending with the weights of a run that never failed."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess

import pytest
import torch

from tests.launch import load_result, run, run_batch

STEPS = 12
FULL = ("--steps", str(STEPS))
LORA = ("--steps", str(STEPS), "--lora", "q_proj,v_proj")


def flags(out: str, model: str, *extra: str) -> list[str]:
    return ["--model", model, "--out", out, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny) -> dict[str, dict]:
    """References (one launch), then each drill: its failing launch(es) and what a relaunch with auto gave."""
    root = tmp_path_factory.mktemp("failures")
    model = tiny("llama")
    out = {name: str(root / name) for name in ("reference", "lora_reference", "agent", "one_rank", "killed")}
    run_batch(
        "train_worker.py",
        2,
        [flags(out["reference"], model, *FULL), flags(out["lora_reference"], model, *LORA)],
        str(root / "batches"),
    )
    # SIGTERM to torchrun's agent after step 3 (it forwards it to every worker); steps take >= 0.3 s. Async
    # saves every 2 steps, so one may still be in flight when the preemption checkpoint starts.
    saves = ("--save-steps", "2", "--async-save")
    signal = ("--signal-at", "3", "--signal-rank", "0", "--signal-to", "agent", "--step-sleep", "0.3")
    agent = run(
        "train_worker.py", 2, *flags(out["agent"], model, *FULL, *saves, *signal), expect_ok=False, torchrun=True
    )
    agent_checkpoints = _checkpoints(out["agent"])
    # The relaunches and the one-rank drill need no agent: their ranks come from the warm fork server.
    run("train_worker.py", 2, *flags(out["agent"], model, *FULL, *saves, "--resume", "auto"))
    # SIGTERM to rank 1 alone after step 3 (a LoRA run): rank 0 must learn of it through the check.
    one_rank = run("train_worker.py", 2, *flags(out["one_rank"], model, *LORA, "--signal-at", "3"), expect_ok=False)
    one_rank_checkpoints = _checkpoints(out["one_rank"])
    one_rank_exported = os.path.exists(os.path.join(out["one_rank"], "run", "adapter_model.safetensors"))
    run("train_worker.py", 2, *flags(out["one_rank"], model, *LORA, "--resume", "auto"))
    # Rank 1 SIGKILLed after step 7 (first attempt only); checkpoints every 5 steps; torchrun restarts once.
    killed = run(
        "train_worker.py",
        2,
        *flags(out["killed"], model, *FULL, "--save-steps", "5", "--kill-at", "7", "--resume", "auto"),
        launcher_args=("--max-restarts=1",),
    )
    return {
        "out": out,
        "agent": {"proc": agent, "checkpoints": agent_checkpoints},
        "one_rank": {"proc": one_rank, "checkpoints": one_rank_checkpoints, "exported": one_rank_exported},
        "killed": {"proc": killed},
    }


def _checkpoints(out: str) -> list[int]:
    return sorted(int(p.rsplit("-", 1)[1]) for p in glob.glob(os.path.join(out, "run", "checkpoint-*")))


def _weights(out: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out, "weights.pt"))


def _assert_same_weights(out: str, reference: str) -> None:
    got, expected = _weights(out), _weights(reference)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differs from the uninterrupted run"


def _saved_step(proc) -> int:
    """The step the preemption message says every rank finished."""
    found = re.findall(r"SIGTERM received: saving checkpoint-(\d+)", proc.stderr + proc.stdout)
    assert len(found) == 1, (proc.stdout[-2000:], proc.stderr[-4000:])
    return int(found[0])


def test_sigterm_to_torchrun_checkpoints_the_step_reached_and_exits_non_zero(runs):
    drill = runs["agent"]
    assert drill["proc"].returncode != 0, "a preempted job must exit non-zero so the scheduler requeues it"
    step = _saved_step(drill["proc"])
    assert 3 < step < STEPS
    assert max(drill["checkpoints"]) == step, "the step reached is the newest checkpoint"
    assert [c for c in drill["checkpoints"] if c != step] == list(range(2, step, 2)), "after every save step before it"
    state_file = os.path.join(runs["out"]["agent"], "run", f"checkpoint-{step}", "trainer_state.json")
    with open(state_file) as f:
        assert json.load(f)["global_step"] == step


def test_relaunch_after_sigterm_ends_with_the_uninterrupted_weights(runs):
    out = runs["out"]
    _assert_same_weights(out["agent"], out["reference"])
    step = _saved_step(runs["agent"]["proc"])
    expected = dict(zip(load_result(out["reference"])["steps"], load_result(out["reference"])["losses"], strict=True))
    resumed = load_result(out["agent"])
    assert resumed["steps_run"] == STEPS - step, "the relaunch went on from the preemption checkpoint"
    assert resumed["losses"] == [expected[s] for s in resumed["steps"]]


def test_a_signal_that_reaches_one_rank_stops_every_rank_after_the_same_step(runs):
    drill = runs["one_rank"]
    assert drill["proc"].returncode != 0
    # Rank 1 signals itself at the end of step 3; the next check (after step 4) is where all ranks agree.
    assert _saved_step(drill["proc"]) == 4 and drill["checkpoints"] == [4]
    checkpoint = os.path.join(runs["out"]["one_rank"], "run", "checkpoint-4")
    assert os.path.isfile(os.path.join(checkpoint, "adapter_model.safetensors")), "a LoRA run: adapter-only"
    assert not drill["exported"], "a preempted run skips the end-of-training export"
    assert drill["proc"].rank_codes[1] == 143, "a preempted worker exits with 128 + SIGTERM"
    _assert_same_weights(runs["out"]["one_rank"], runs["out"]["lora_reference"])


def test_a_killed_rank_under_max_restarts_resumes_and_ends_with_the_uninterrupted_weights(runs):
    proc = runs["killed"]["proc"]
    assert "exitcode: -9" in proc.stderr, "rank 1 was SIGKILLed and torchrun restarted the workers"
    assert "connectFullMesh" not in proc.stderr
    assert load_result(runs["out"]["killed"])["steps_run"] == STEPS - 5, "the restarted workers resumed at step 5"
    _assert_same_weights(runs["out"]["killed"], runs["out"]["reference"])


CRASHING_WORKER = """
import faulthandler, os, sys
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    os.abort()  # native crash: faulthandler writes this rank's stack to its stderr
print("peer noise\\n" * 2000, file=sys.stderr, flush=True)  # more than the whole report keeps
dist.barrier()  # fails once rank 0 is gone: the "connection reset" that used to be all a report showed
"""


def test_a_rank_that_crashes_natively_shows_its_own_stack_before_the_peers_noise(tmp_path):
    """A parity batch once failed with one rank's SIGABRT while the report showed only the other rank's
    "Connection reset by peer": the report now gives each rank's tail, the one that failed by itself first."""
    worker = tmp_path / "crashing_worker.py"
    worker.write_text(CRASHING_WORKER)
    with pytest.raises(AssertionError) as failure:
        run(str(worker), 2)
    report = str(failure.value)
    assert report.index("--- rank 0 (exit code -6) ---") < report.index("--- rank 1")
    assert "failed (-6)" in report, "the code of the rank that crashed, not of the one stopped after it"
    assert "Fatal Python error: Aborted" in report and "crashing_worker.py" in report


HANGING_WORKER = """
import os, time

if os.environ["RANK"] == "1":
    time.sleep(600)  # rank 1 hangs here
time.sleep(600)  # rank 0 here
"""


def test_a_launch_that_times_out_reports_where_each_rank_hung(tmp_path):
    """A 2-rank batch once ran past pytest's limit and left no clue: on timeout each rank now dumps every thread's
    stack (faulthandler, SIGUSR2) before it is stopped, and the timeout carries them."""
    worker = tmp_path / "hanging_worker.py"
    worker.write_text(HANGING_WORKER)
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        run(str(worker), 2, timeout=5)
    report = timeout.value.stderr
    assert re.search(r"--- rank 1 .*---\n(.|\n)*hanging_worker\.py\", line 5", report), report
    assert re.search(r"--- rank 0 .*---\n(.|\n)*hanging_worker\.py\", line 6", report), report


def test_an_empty_kernel_left_by_a_killed_compile_is_removed_from_the_shared_cache(tmp_path):
    """The suite shares torch.compile's kernel cache between runs; an empty .so (a compile killed mid-write) once made
    every later torch 2.11 run fail to load it. Only empty kernels go; sources and whole kernels stay."""
    from tests.conftest import _drop_empty_kernels

    (tmp_path / "ea").mkdir()
    empty, whole, source = tmp_path / "ea" / "k.main.so", tmp_path / "ea" / "w.main.so", tmp_path / "ea" / "k.main.cpp"
    empty.write_bytes(b"")
    whole.write_bytes(b"\x7fELF")
    source.write_text("")
    assert _drop_empty_kernels(str(tmp_path)) == [str(empty)]
    assert sorted(p.name for p in (tmp_path / "ea").iterdir()) == ["k.main.cpp", "w.main.so"]
