"""Sharded checkpoints: layout, crash safety, exact resume on the same and other world sizes, async save."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
from transformers.trainer_utils import get_last_checkpoint

from hf_fsdp2.checkpoints.sharded import read_metadata
from tests.launch import load_result, run, run_batch
from tests.workers.scenarios import ERROR_FILE

MODEL = "llama_tied"
STEPS = ("--save-steps", "2", "--steps", "6")


def ckpt_run(out: str, *flags: str, model: str = MODEL) -> list[str]:
    return ["--model", model, "--out", out, *STEPS, *flags]


def resumed_from(out: str, source: str, checkpoint: str, *flags: str, model: str = MODEL) -> list[str]:
    """A run that starts from a copy of `source`'s checkpoint and resumes the last one it finds."""
    return ckpt_run(
        out, "--seed-checkpoint", os.path.join(source, "run", checkpoint), "--resume", "last", *flags, model=model
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny) -> dict[str, str]:
    """Every run this module checks, in dependency order, one launch per world size and stage.

    `reference` is an uninterrupted 2-rank run saving every 2 steps: the numbers every resume must reproduce.
    """
    root = tmp_path_factory.mktemp("checkpoints")
    out = {
        name: str(root / name)
        for name in (
            "reference",
            "four",
            "to4",
            "to1",
            "to2",
            "four_to2",
            "async",
            "async_resumed",
            "direct",
            "direct_resumed",
            "limit",
            "mismatch",
            "auto_fresh",
            "auto_fallback",
            "finished",
        )
    }
    model, other = tiny(MODEL), tiny("llama")
    batches = str(root / "batches")
    run_batch("train_worker.py", 2, [[*ckpt_run(out["reference"], model=model)]], batches)
    run_batch(
        "train_worker.py",
        4,
        [
            ckpt_run(out["four"], "--grad-accum", "1", model=model),
            resumed_from(out["to4"], out["reference"], "checkpoint-2", "--grad-accum", "1", model=model),
        ],
        batches,
    )
    run_batch("train_worker.py", 1, [resumed_from(out["to1"], out["reference"], "checkpoint-2", model=model)], batches)
    damaged_copy(out["reference"], os.path.join(out["auto_fallback"], "run"))
    last = run_batch(
        "train_worker.py",
        2,
        [
            resumed_from(out["to2"], out["reference"], "checkpoint-2", model=model),
            resumed_from(out["four_to2"], out["four"], "checkpoint-4", model=model),
            ckpt_run(out["async"], "--async-save", "--slow-staging", "0.5", model=model),
            resumed_from(out["async_resumed"], out["async"], "checkpoint-4", model=model),
            ckpt_run(out["direct"], "--async-save", "--checkpoint-writes", "direct", model=model),
            resumed_from(out["direct_resumed"], out["direct"], "checkpoint-4", model=model),
            ckpt_run(out["limit"], "--save-total-limit", "1", model=model),
            resumed_from(out["mismatch"], out["reference"], "checkpoint-2", model=other),
            ckpt_run(out["auto_fresh"], "--resume", "auto", model=model),
            ckpt_run(out["auto_fallback"], "--resume", "auto", model=model),
            ckpt_run(
                out["finished"],
                "--seed-checkpoint",
                os.path.join(out["reference"], "run", "checkpoint-6"),
                "--resume",
                "auto",
                model=model,
            ),
        ],
        batches,
    )
    with open(os.path.join(root, "last_batch.log"), "w") as f:
        f.write(last.stdout + last.stderr)
    out["log"] = os.path.join(root, "last_batch.log")
    return out


def damaged_copy(source: str, run_dir: str) -> None:
    """checkpoint-2 and checkpoint-4 of `source`, the newest with one model shard cut short (a full disk)."""
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(os.path.join(source, "run", name), os.path.join(run_dir, name))
    shard = sorted(glob.glob(os.path.join(run_dir, "checkpoint-4", "pytorch_model_fsdp_0", "*.distcp")))[0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)


@pytest.fixture(scope="module")
def reference(runs) -> str:
    return runs["reference"]


def losses_by_step(out: str) -> dict[int, float]:
    result = load_result(out)
    return dict(zip(result["steps"], result["losses"], strict=True))


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


@pytest.mark.parametrize("name, tol", [("to2", 1e-6), ("to1", 1e-4), ("to4", 1e-4)], ids=["2->2", "2->1", "2->4"])
def test_resume_continues_the_loss_curve(runs, name, tol):
    expected, got = losses_by_step(runs["reference"]), losses_by_step(runs[name])
    for step in (3, 4, 5, 6):
        assert abs(got[step] - expected[step]) <= tol, f"step {step}: {got[step]} vs {expected[step]}"


def test_resume_from_four_ranks_on_two(runs):
    expected, got = losses_by_step(runs["reference"]), losses_by_step(runs["four_to2"])
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


def test_a_rank_killed_during_an_async_saves_overlapped_copy_loses_nothing_saved_before(tmp_path, tiny, reference):
    """An asynchronous save's host copy runs beside the next step; a rank dying there (out of host memory, a node
    lost) must leave the earlier checkpoint the one to resume, and the half-made one hidden."""
    out = str(tmp_path)
    flags = ("--model", tiny(MODEL), "--out", out, *STEPS, "--async-save")
    # Each save copies two parts (the model, the optimizer): the third copy is the step-4 save's first.
    proc = run("train_worker.py", 2, *flags, "--kill-in-copy", "3", expect_ok=False)
    assert proc.returncode != 0 and proc.rank_codes[1] == -9
    run_dir = os.path.join(out, "run")
    assert sorted(os.listdir(run_dir)) == [".checkpoint-4.incomplete", "checkpoint-2"]
    run("train_worker.py", 2, *flags, "--resume", "last")
    expected, got = losses_by_step(reference), losses_by_step(out)
    for step in (3, 4, 5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6


def test_an_async_checkpoint_is_published_once_written_not_at_the_next_save(tmp_path, tiny, reference):
    """Saved at step 3, killed after step 5, the next save due at step 6: checkpoint-3 was whole on disk since step 4,
    and used to stay hidden (published only by the next save), so the relaunch started over."""
    out = str(tmp_path)
    flags = ("--model", tiny(MODEL), "--out", out, "--save-steps", "3", "--steps", "6", "--async-save")
    proc = run("train_worker.py", 2, *flags, "--kill-at", "5", "--step-sleep", "0.3", expect_ok=False)
    assert proc.returncode != 0 and proc.rank_codes[1] == -9
    run_dir = os.path.join(out, "run")
    assert os.listdir(run_dir) == ["checkpoint-3"]
    run("train_worker.py", 2, *flags, "--resume", "last")
    expected, got = losses_by_step(reference), losses_by_step(out)
    assert load_result(out)["steps_run"] == 3, "the relaunch resumed from checkpoint-3"
    for step in (4, 5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6


def test_async_save_trains_identically_and_resumes_exactly(runs):
    assert losses_by_step(runs["async"]) == losses_by_step(runs["reference"])
    assert get_last_checkpoint(os.path.join(runs["async"], "run")).endswith("checkpoint-6")
    expected, got = losses_by_step(runs["reference"]), losses_by_step(runs["async_resumed"])
    for step in (5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6


def saved_tensors(folder: str, scratch: str) -> dict[str, object]:
    """Every tensor of a DCP folder, whole, by flattened key (read in this process through a torch.save file)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(scratch, "part.pt")
    dcp_to_torch_save(folder, path)
    flat: dict[str, object] = {}

    def walk(value: object, key: str) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                walk(inner, f"{key}.{name}")
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk(inner, f"{key}.{index}")
        elif isinstance(value, torch.Tensor):
            flat[key] = value

    walk(torch.load(path, weights_only=True), "")
    os.remove(path)
    return flat


def test_async_checkpoints_hold_exactly_the_state_of_their_step(runs, tmp_path):
    """The async run's host copies start 0.5 s late (`--slow-staging`), so the step after each save reaches its
    optimizer step while the copy is pending: the trainer waits for it there (on_pre_optimizer_step), and every
    checkpoint equals the sync reference run's of the same step, tensor for tensor (the model's and AdamW's state).

    Planted break it caught: no wait before the optimizer step (the callback left out): checkpoint-2 and checkpoint-4
    held the following step's weights and optimizer state.
    """
    import torch

    for step in (2, 4, 6):
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            name = os.path.join(f"checkpoint-{step}", part)
            ours = saved_tensors(os.path.join(runs["async"], "run", name), str(tmp_path))
            theirs = saved_tensors(os.path.join(runs["reference"], "run", name), str(tmp_path))
            assert ours.keys() == theirs.keys() and len(ours) > 0, name
            different = [key for key in ours if not torch.equal(ours[key], theirs[key])]
            assert different == [], (name, different[:5])


def test_direct_checkpoint_writes_resume_exactly(runs):
    """checkpoint_writes="direct" (O_DIRECT files, here saved asynchronously) resumes as the cached writes do."""
    expected, got = losses_by_step(runs["reference"]), losses_by_step(runs["direct_resumed"])
    for step in (5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6
    model_files = os.listdir(os.path.join(runs["direct"], "run", "checkpoint-6", "pytorch_model_fsdp_0"))
    assert sorted(model_files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # rank 0's files, 3 saves: model and optimizer shards, and each folder's .metadata
    assert sorted(load_result(runs["direct"])["direct_files"]) == sorted(["__0_0.distcp"] * 6 + [".metadata.tmp"] * 6)
    assert load_result(runs["reference"])["direct_files"] == []  # the default: DCP's own buffered files


def test_save_total_limit_rotates_checkpoints(runs):
    names = [n for n in os.listdir(os.path.join(runs["limit"], "run")) if n.startswith("checkpoint-")]
    assert names == ["checkpoint-6"]


def test_resuming_a_checkpoint_of_another_model_names_the_first_mismatch(runs):
    with open(os.path.join(runs["mismatch"], ERROR_FILE)) as f:
        assert "the checkpoint has no lm_head.weight: it was saved from another model" in f.read()


def test_auto_resume_on_an_empty_output_dir_starts_fresh(runs):
    assert losses_by_step(runs["auto_fresh"]) == losses_by_step(runs["reference"])


def test_auto_resume_skips_a_truncated_newest_checkpoint_and_deletes_nothing(runs):
    run_dir = os.path.join(runs["auto_fallback"], "run")
    with open(runs["log"]) as f:
        log = f.read()
    assert f"Not resuming from {run_dir}/checkpoint-4, which cannot be read: " in log
    assert (
        "pytorch_model_fsdp_0/__0_0.distcp: truncated" in log or "pytorch_model_fsdp_0/__1_0.distcp: truncated" in log
    )
    expected, got = losses_by_step(runs["reference"]), losses_by_step(runs["auto_fallback"])
    for step in (3, 4, 5, 6):
        assert abs(got[step] - expected[step]) <= 1e-6


def test_relaunching_a_finished_run_trains_nothing_and_only_exports_again(runs):
    """A scheduler's relaunch of a job whose newest checkpoint reached max_steps: Trainer would run a step at
    learning rate 0 (moving Adam's moments) and write checkpoint-7; we train nothing and redo the export."""
    import torch
    from safetensors.torch import load_file

    run_dir = os.path.join(runs["finished"], "run")
    assert load_result(runs["finished"])["steps_run"] == 0
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint-")) == ["checkpoint-6"]
    assert losses_by_step(runs["finished"]) == losses_by_step(runs["reference"])
    exported = load_file(os.path.join(run_dir, "model.safetensors"))
    trained = torch.load(os.path.join(runs["reference"], "weights.pt"))
    assert all(torch.equal(exported[k].float(), trained[k]) for k in exported)
    with open(runs["log"]) as f:
        assert f.read().count("already reached max_steps=6: nothing left to train") == 1


def test_the_checks_name_the_damaged_file_and_delete_nothing(runs, tmp_path):
    from hf_fsdp2.checkpoints.resume import checkpoint_problem, checkpoints_newest_first

    run_dir = str(tmp_path / "run")
    damaged_copy(runs["reference"], run_dir)
    (tmp_path / "run" / ".checkpoint-6.incomplete").mkdir()  # a save that never finished is not a candidate
    newest, older = checkpoints_newest_first(run_dir)
    assert newest.endswith("checkpoint-4") and older.endswith("checkpoint-2")
    assert "truncated" in checkpoint_problem(newest) and checkpoint_problem(older) is None
    with open(os.path.join(older, "pytorch_model_fsdp_0", ".metadata"), "wb") as f:
        f.write(b"garbage\n")
    assert ".metadata is not valid DCP metadata (truncated or corrupted)" in checkpoint_problem(older)
    assert sorted(os.listdir(run_dir)) == [".checkpoint-6.incomplete", "checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize(
    "variant",
    [(), ("lora",), ("full_state",), ("lora", "full_state")],
    ids=["full", "lora", "full_state_dict", "lora_full_state_dict"],
)
def test_a_run_accelerate_started_finishes_exactly_with_fsdp2_trainer(tmp_path, tiny, variant):
    """Coming from Trainer + Accelerate's FSDP2 plugin: its SHARDED_STATE_DICT checkpoint-2 resumed by
    FSDP2Trainer continues the loss curve and ends at the weights of the uninterrupted Accelerate run. With LoRA,
    Accelerate kept the adapter inside its sharded model state (no adapter_model.safetensors): read from there.
    FULL_STATE_DICT checkpoints (pytorch_model_fsdp.bin, optimizer.bin) resume too, each rank taking its shards."""
    run("accelerate_resume_worker.py", 2, tiny("llama"), str(tmp_path), *variant)
    result = load_result(str(tmp_path))
    theirs, ours = result["accelerate"], result["ours"]
    assert len(theirs) == 4 and len(ours) == 4  # the resumed history holds the checkpoint's two steps
    assert all(abs(a - b) <= 1e-5 for a, b in zip(theirs[2:], ours[2:], strict=True)), (theirs, ours)
    assert result["max_weight_diff"] <= 1e-5


def test_dcp_files_are_written_through_direct_io(tmp_path, monkeypatch):
    """Every file DCP writes for us goes through direct_io, and the checkpoint reads back exactly."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hf_fsdp2.checkpoints import sharded_save as checkpoint
    from hf_fsdp2.checkpoints.direct_io import DirectStream

    written = []

    class Recorded(DirectStream):
        def __init__(self, path: str) -> None:
            written.append(os.path.basename(path))
            super().__init__(path)

    monkeypatch.setattr(checkpoint, "DirectStream", Recorded)
    state = {"a": torch.randn(1000, 7), "b": torch.arange(5), "c": torch.randn(3).to(torch.bfloat16)}
    folder = str(tmp_path / "dcp")
    dcp.save(state, storage_writer=checkpoint.storage_writer(folder, direct=True), no_dist=True)
    data_files = [name for name in os.listdir(folder) if name != ".metadata"]
    assert data_files and sorted(written) == sorted([*data_files, ".metadata.tmp"])  # then renamed to .metadata
    back = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(back, checkpoint_id=folder, no_dist=True)
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_a_full_disk_fails_the_dcp_save_loudly(tmp_path, monkeypatch):
    import errno

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hf_fsdp2.checkpoints import direct_io
    from hf_fsdp2.checkpoints import sharded_save as checkpoint

    def full_disk(fd: int, data: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "pwrite_all", full_disk)
    open_before = len(os.listdir("/proc/self/fd"))
    writer = checkpoint.storage_writer(str(tmp_path / "x"), direct=True)
    with pytest.raises(CheckpointException, match="No space left"):  # DCP's own (a BaseException)
        dcp.save({"a": torch.randn(100)}, storage_writer=writer, no_dist=True)
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert not os.path.exists(tmp_path / "x" / ".metadata")  # no folder that looks complete


def test_the_parts_of_a_sync_save_are_written_at_once_and_a_failure_in_either_is_raised():
    """A sync save writes the model and the optimizer each in its own thread (their writes and fsyncs overlap);
    a part that fails is raised in the trainer's thread once the other part is done, DCP's BaseException too."""
    import threading

    from torch.distributed.checkpoint.api import CheckpointException

    from hf_fsdp2.checkpoints.sharded_save import run_at_once

    both_started = threading.Barrier(2, timeout=10)  # broken (an error) if the parts ran one after the other
    done = []
    run_at_once([lambda part=part: (both_started.wait(), done.append(part)) for part in ("model", "optim")])
    assert sorted(done) == ["model", "optim"]

    disk_full = OSError(28, "No space left on device")

    def full_disk() -> None:
        raise CheckpointException("save failed", {0: disk_full})

    with pytest.raises(CheckpointException) as failed:
        run_at_once([full_disk, lambda: done.append("optim again")])
    assert failed.value.failures == {0: disk_full} and done[-1] == "optim again"


def test_every_async_save_of_a_run_holds_exactly_its_state_and_reuses_its_host_buffers(tmp_path):
    """Three async saves through one PartSavers, each followed by the next step while the state is copied to host
    memory (the copy made slower than the forward and backward), the wait for the copy, and the optimizer step while
    the save is written: each checkpoint reads back exactly (weights, AdamW's state, and BatchNorm's statistics, which
    that forward changed), and the 2nd and 3rd copies went into the 1st's host buffers.

    Planted breaks it caught: `wait_for_staging` returning without waiting (saves held the next step's weights and
    AdamW state); BatchNorm's buffers copied live instead of snapshotted (saves held the next forward's statistics);
    a fresh copier at each save, as torch 2.11's DefaultStager amounts to (buffers_reused [None, False, False]).
    Passes on torch 2.11, 2.13 and 2.15.
    """
    run("async_save_worker.py", 2, "--out", str(tmp_path), "--slow-staging", "0.5")
    for rank in (0, 1):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            result = json.load(f)
        assert result["mismatched"] == [], result["mismatched"]
        # per save: 9 model tensors (2 linears' weight and bias; BatchNorm's weight, bias and 3 buffers), and AdamW's
        # step, exp_avg and exp_avg_sq of each of the 6 parameters
        assert result["compared"] == 3 * (9 + 18)
        assert result["buffers_reused"] == [None, True, True]


def test_a_full_state_file_of_another_shape_is_refused_naming_the_tensor_before_any_is_copied(tmp_path):
    """A FULL_STATE_DICT checkpoint (Accelerate's `pytorch_model_fsdp.bin`) from a model with other sizes."""
    import torch

    from hf_fsdp2.checkpoints.full_state import FULL_MODEL_FILE, load_full_model_state

    torch.save({"a": torch.ones(2), "b": torch.ones(3, 4)}, tmp_path / FULL_MODEL_FILE)
    live = {"a": torch.zeros(2), "b": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match=r"^b has shape \(3, 4\) in .* but \(4, 4\) in the model\.$"):
        load_full_model_state(live, str(tmp_path))
    assert live["a"].sum() == 0, "nothing is copied before every shape is checked"
