"""scripts/measure/gpu_check.py rehearsed on the CPU: every part of the GPU check runs at tiny sizes through the same
code, so the script a lent GPU gets cannot rot between loans; and the docs' GPU table is its committed result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.docs_blocks import marked_block
from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "measure"))
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One whole dry run (about 40 s on 2 CPU cores: its workers are forked from one that imported once)."""
    work = tmp_path_factory.mktemp("gpu_check")
    script = os.path.join(ROOT, "scripts", "measure", "gpu_check.py")
    command = [sys.executable, script, "--dry-run", "--workdir", str(work)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(work / "gpu_dry_run.json") as f:
        return json.load(f)


def test_every_part_runs_and_only_cpu_offload_is_refused_on_the_cpu(dry_run):
    parts = dry_run["parts"]
    assert list(parts) == ["build", *gpu_check.PARTS]
    for name, part in parts.items():
        runs = part.get("runs", {})
        assert runs, name
        for run_name, run in runs.items():
            if name == "offload":  # FSDP2Trainer refuses cpu_offload without an accelerator, by name
                assert "cpu_offload=True moves shards from an accelerator" in run["error"]
            else:
                assert "error" not in run, (name, run_name, run["error"])


def test_the_rehearsal_measures_what_the_gpu_run_reports(dry_run):
    parts = dry_run["parts"]
    ours, plain = parts["parity"]["runs"]["hf_fsdp2 fp32"], parts["parity"]["runs"]["trainer fp32"]
    assert max(abs(a - b) for a, b in zip(ours["losses"], plain["losses"], strict=True)) <= gpu_check.FP32_TOLERANCE
    assert ours["losses"][-1] < ours["losses"][0]  # the pattern data is learnt
    for run in parts["throughput"]["runs"].values():
        assert run["tokens_per_s"] > 0 and run["train_peak_mib"] is not None and len(run["step_s"]) == 4
    assert parts["generation"]["runs"]["generate"]["same_tokens"]  # gathered greedy decoding = the plain model's
    saved = parts["checkpoints"]["runs"]["checkpoints"]
    assert len(saved["sync_save_blocked_s"]) == len(saved["async_save_blocked_s"]) == 2
    assert saved["resume_s"] > 0 and saved["consolidated_bytes"] > 0
    planned = parts["planner"]["runs"]["planner"]["rows"]
    # every FSDP2Trainer training run outside parity but the refused offload one
    assert len(planned) == 2 + 1 + 2 + 4 and all(row["planned_mib"] > 0 for row in planned)
    table = gpu_check.render_markdown(dry_run)
    assert "| bf16 |" in table and "| fp32 | 0.00e+00 (within)" in table


def test_a_part_that_would_not_fit_the_budget_is_skipped_and_says_so(tmp_path, monkeypatch):
    """With 80 s, 35 kept back for the planner: no part estimated above 45 s starts; the planner still runs."""
    ran = []
    monkeypatch.setattr(gpu_check, "run_workers", lambda args, env, part, runs, timeout: ran.append(part) or {})
    args = gpu_check.parse_args(["--budget-s", "80", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    results = gpu_check.run_check(args)
    assert ran == ["build", "collectives", "compile", "qlora", "offload", "planner"]  # estimated at 30-40 s
    assert results["parts"]["parity"]["status"].startswith("skipped: 45 s left of the budget, ~60 s needed")
    with open(tmp_path / "r.json") as f:  # written as the parts went
        assert json.load(f)["parts"]["throughput"]["status"].startswith("skipped")


@pytest.mark.parametrize(("results_file", "marker", "device"), [
    ("gpu_h100.json", "gpu", "NVIDIA H100 80GB HBM3"),
    ("gpu_h200.json", "gpu-h200", "NVIDIA H200"),
])  # fmt: skip
def test_docs_gpu_tables_are_the_committed_runs(results_file, marker, device):
    """docs/performance.md's GPU tables are rendered from scripts/results/gpu_*.json, never typed: re-render with
    `python scripts/measure/gpu_check.py --from-json scripts/results/gpu_h100.json` (or gpu_h200.json)."""
    with open(os.path.join(ROOT, "scripts", "results", results_file)) as f:
        results = json.load(f)
    assert marked_block("performance.md", marker).strip() == gpu_check.render_markdown(results).strip()
    assert results["environment"]["device_name"] == device


def test_the_h200_check_drove_every_collective_path_through_nccl():
    with open(os.path.join(ROOT, "scripts", "results", "gpu_h200.json")) as f:
        paths = json.load(f)["parts"]["collectives"]["runs"]["collective paths"]
    assert paths["backend"] == "nccl" and set(paths["paths"].values()) == {"ok"}
