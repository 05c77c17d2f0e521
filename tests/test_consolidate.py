"""Consolidation into Hugging Face folders (offline CLI, save_model, end of training) and bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_fsdp2 import consolidate
from tests.launch import load_result, run, run_cli

PROBE = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny) -> str:
    """A 2-rank run with checkpoints every 2 steps; result.json holds the sharded model's final logits."""
    out = str(tmp_path_factory.mktemp("trained"))
    run("train_worker.py", 2, "--model", tiny("llama_tied"), "--out", out, "--save-steps", "2", "--steps", "4")
    return out


def logits_of(folder: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def sharded_logits(trained: str) -> torch.Tensor:
    return torch.tensor(load_result(trained)["logits"])


def test_end_of_training_folder_reloads_with_equal_logits(trained):
    folder = os.path.join(trained, "run")
    assert torch.allclose(logits_of(folder), sharded_logits(trained), atol=1e-5, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight


# What the consolidation command must not import: together they took ~4.5 s of its ~7.5 s at 100M on 2 cores, when
# `accelerate merge-weights` needed 5 s in all (scripts/benchmark/benchmark.py's "consolidation command" row).


def test_cli_consolidates_the_last_checkpoint_into_a_loadable_folder_without_the_training_stack(trained, tmp_path):
    output = tmp_path / "hf"
    # The real entry point's module run as `python -m hf_fsdp2.cli`, then the modules the process imported.
    proc = run_cli("consolidate", os.path.join(trained, "run", "checkpoint-4"), str(output))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "IMPORTED"
    assert sorted(os.listdir(output)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert torch.allclose(logits_of(str(output)), sharded_logits(trained), atol=1e-5, rtol=0)


def test_one_rank_of_a_running_job_consolidates_alone(trained, tmp_path):
    output = str(tmp_path / "hf")
    run("consolidate_one_rank_worker.py", 2, os.path.join(trained, "run", "checkpoint-4"), output, timeout=120)
    assert torch.allclose(logits_of(output), sharded_logits(trained), atol=1e-5, rtol=0)


def test_consolidating_the_model_subfolder_and_sharding_with_an_index(trained, tmp_path):
    model_dir = os.path.join(trained, "run", "checkpoint-4", "pytorch_model_fsdp_0")
    consolidate(model_dir, str(tmp_path / "hf"), max_shard_size="20KB")
    files = sorted(os.listdir(tmp_path / "hf"))
    assert "model.safetensors.index.json" in files
    assert any(name.startswith("model-00001-of-") for name in files)
    with open(tmp_path / "hf" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert all(os.path.getsize(tmp_path / "hf" / name) <= 40_000 for name in set(index["weight_map"].values()))
    assert torch.allclose(logits_of(str(tmp_path / "hf")), sharded_logits(trained), atol=1e-5, rtol=0)


def test_cli_applies_and_records_the_export_dtype_and_the_shard_size(trained, tmp_path):
    """The command's --dtype and --max-shard-size reach the export (not only consolidate()'s arguments)."""
    output = tmp_path / "bf16"
    proc = run_cli("consolidate", os.path.join(trained, "run", "checkpoint-4"), str(output), "--dtype", "bfloat16",
                   "--max-shard-size", "20KB")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with open(output / "model.safetensors.index.json") as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1 and all(os.path.getsize(output / name) <= 40_000 for name in files)
    assert {t.dtype for name in files for t in load_file(str(output / name)).values()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(str(output)).dtype == torch.bfloat16


def test_configs_name_the_real_class_and_an_old_checkpoints_fsdp_name_is_mended(trained, tmp_path):
    """fully_shard swaps the class for FSDP<Class>; configs must name LlamaForCausalLM (tools load by name).
    A checkpoint an earlier version wrote with the generated name is mended by the offline consolidation."""
    checkpoint = os.path.join(trained, "run", "checkpoint-4")
    for folder in (checkpoint, os.path.join(trained, "run")):
        with open(os.path.join(folder, "config.json")) as f:
            assert json.load(f)["architectures"] == ["LlamaForCausalLM"], folder
    old = tmp_path / "old-checkpoint"
    shutil.copytree(checkpoint, old)
    with open(old / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["FSDPLlamaForCausalLM"]
    with open(old / "config.json", "w") as f:
        json.dump(config, f)
    consolidate(str(old), str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        mended = json.load(f)
    assert mended == {**config, "architectures": ["LlamaForCausalLM"]}


def test_accelerate_merge_weights_reads_our_checkpoint(trained, tmp_path):
    checkpoint = os.path.join(trained, "run", "checkpoint-4")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.accelerate_cli",
            "merge-weights",
            os.path.join(checkpoint, "pytorch_model_fsdp_0"),
            str(tmp_path / "acc"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    consolidate(checkpoint, str(tmp_path / "ours"))
    theirs = load_file(str(tmp_path / "acc" / "model.safetensors"))
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_accelerate_format_checkpoint_with_tied_duplicates_consolidates(tiny, tmp_path):
    """Trainer + Accelerate write {"model": model.state_dict()} with FileSystemWriter (tied head included)."""
    import torch.distributed.checkpoint as dcp

    reference = AutoModelForCausalLM.from_pretrained(tiny("llama_tied"))
    checkpoint = tmp_path / "checkpoint-10"
    dcp.save(
        {"model": reference.state_dict()},
        storage_writer=dcp.FileSystemWriter(str(checkpoint / "pytorch_model_fsdp_0")),
        no_dist=True,
    )
    shutil.copy(os.path.join(tiny("llama_tied"), "config.json"), checkpoint / "config.json")
    consolidate(str(checkpoint), str(tmp_path / "hf"))
    assert torch.equal(logits_of(str(tmp_path / "hf")), logits_of(tiny("llama_tied")))


# ---- bad input: a clear error, nothing lost on disk -------------------------------------------------------


def cli_error(*args: str) -> str:
    """The CLI's error text, run in-process (test_cli_consolidates... runs the real entry point once)."""
    from hf_fsdp2.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["consolidate", *args])
    assert status == 2, err.getvalue()
    return err.getvalue()


def test_a_path_that_is_not_a_checkpoint(tmp_path, tiny):
    error = cli_error(str(tmp_path / "nope"), str(tmp_path / "out"))
    assert "is not a directory" in error and "Can't find a valid checkpoint at" in error  # Trainer's words first
    assert "is not a sharded checkpoint: it has no pytorch_model_fsdp_0/" in cli_error(
        tiny("llama"), str(tmp_path / "out")
    )


def test_an_incomplete_checkpoint_without_metadata(trained, tmp_path):
    broken = tmp_path / "checkpoint-4"
    shutil.copytree(os.path.join(trained, "run", "checkpoint-4"), broken)
    os.remove(broken / "pytorch_model_fsdp_0" / ".metadata")
    assert "has no .metadata: the checkpoint is incomplete or corrupted" in cli_error(
        str(broken), str(tmp_path / "out")
    )
    assert not (tmp_path / "out").exists()


def test_a_truncated_shard_is_reported_and_leaves_no_output(trained, tmp_path):
    broken = tmp_path / "checkpoint-4"
    shutil.copytree(os.path.join(trained, "run", "checkpoint-4"), broken)
    shard = broken / "pytorch_model_fsdp_0" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    message = cli_error(str(broken), str(tmp_path / "out"))
    assert "corrupted" in message or "truncated" in message
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.incomplete").exists()


def test_a_non_empty_output_is_refused_and_kept(trained, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "precious.txt").write_text("keep me")
    assert "exists and is not empty; choose another folder or pass --overwrite" in cli_error(
        os.path.join(trained, "run", "checkpoint-4"), str(output)
    )
    assert (output / "precious.txt").read_text() == "keep me"
    proc = run_cli("consolidate", os.path.join(trained, "run", "checkpoint-4"), str(output), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (output / "model.safetensors").is_file(), "--overwrite writes into the non-empty folder"


def test_checkpoint_metadata_is_not_unpickled_blindly(trained, tmp_path):
    broken = tmp_path / "checkpoint-4"
    shutil.copytree(os.path.join(trained, "run", "checkpoint-4"), broken)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    with open(broken / "pytorch_model_fsdp_0" / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    message = cli_error(str(broken), str(tmp_path / "out"))
    assert "refusing to unpickle" in message
    assert not (tmp_path / "pwned").exists()


def test_an_optimizer_folder_is_not_a_model(trained, tmp_path):
    message = cli_error(os.path.join(trained, "run", "checkpoint-4", "optimizer_0"), str(tmp_path / "out"))
    assert "holds no model tensors (is it an optimizer_0 folder?)" in message


def test_tokenizer_files_travel_with_checkpoints_and_exports(tmp_path, tiny):
    from transformers import AutoTokenizer

    run(
        "train_worker.py",
        2,
        "--model",
        tiny("llama"),
        "--out",
        str(tmp_path),
        "--save-steps",
        "2",
        "--steps",
        "2",
        "--tokenizer",
    )
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "tokenizer.json").is_file() and (tmp_path / "run" / "tokenizer.json").is_file()
    consolidate(str(checkpoint), str(tmp_path / "hf"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer("t5 t9").input_ids == [5, 9]


def test_reads_are_batched_in_order_within_the_budget():
    from hf_fsdp2.export.consolidation import read_batches
    from hf_fsdp2.export.hf_folder import TensorSpec

    specs = [TensorSpec(name, (n,), torch.float32) for name, n in [("a", 4), ("b", 4), ("c", 10), ("d", 2), ("e", 1)]]
    batches = [[s.name for s in batch] for batch in read_batches(specs, budget=40)]
    assert batches == [["a", "b"], ["c"], ["d", "e"]]  # 32 B, then c alone (40 B), then 12 B
    assert [s.name for batch in read_batches(specs, budget=1) for s in batch] == list("abcde")


def test_streamed_file_across_staging_buffers_holds_every_tensor(tmp_path, monkeypatch):
    """Tensors cut across the writer's staging buffers (one block each here) keep their order and bytes."""
    from hf_fsdp2.checkpoints import direct_io
    from hf_fsdp2.export.hf_folder import SafetensorsStream, TensorSpec

    monkeypatch.setattr(direct_io, "CHUNK_BYTES", direct_io.BLOCK)
    tensors = {f"t{i}": torch.randn(50 + 37 * i, 3) for i in range(12)}
    tensors["bf16"] = torch.randn(7).to(torch.bfloat16)
    path = str(tmp_path / "x.safetensors")
    stream = SafetensorsStream(path, [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()])
    for tensor in tensors.values():
        stream.write(tensor)
    stream.close()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert os.path.getsize(path) > 4 * direct_io.BLOCK  # it did span several staging buffers


def test_a_failed_fetch_leaves_no_file_open(tmp_path):
    """A read that fails mid-export (a corrupt shard) closes the file being written before the error surfaces."""
    from hf_fsdp2.export.hf_folder import TensorSpec, write_weights

    specs = [TensorSpec(f"t{i}", (1000,), torch.float32) for i in range(4)]

    def fetch(spec: TensorSpec) -> torch.Tensor:
        if spec.name == "t2":
            raise ValueError("corrupt shard")
        return torch.ones(1000)

    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="corrupt shard"):
        write_weights(str(tmp_path), specs, fetch)
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_shard_plan_is_huggingface_hubs_and_write_order_follows_it():
    import torch

    from hf_fsdp2.export.hf_folder import TensorSpec, plan_files, write_order

    specs = [
        TensorSpec("a", (10,), torch.float32),
        TensorSpec("big", (100,), torch.float32),
        TensorSpec("c", (5,), torch.float32),
    ]
    files, split = plan_files(specs, 200)
    # huggingface_hub gives a tensor larger than the limit its own file, ahead of the file still being filled
    assert [(name, [s.name for s in group]) for name, group in files] == [
        ("model-00001-of-00002.safetensors", ["big"]),
        ("model-00002-of-00002.safetensors", ["a", "c"]),
    ]
    assert split.metadata == {"total_size": 460}
    assert [s.name for s in write_order(specs, 200)] == ["big", "a", "c"]
    assert [name for name, _ in plan_files(specs, "5GB")[0]] == ["model.safetensors"]
