"""scripts/measure/gpu_check.py rehearsed on the CPU: every part of the GPU check runs at tiny sizes through the same
code, so the script a lent GPU gets cannot rot between loans; and the docs' GPU table is its committed result."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.docs_blocks import marked_block
from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "measure"))
import gpu_check  # noqa: E402
from gpu_parts import switches  # noqa: E402
from gpu_parts.common import FP16_REL_TOLERANCE  # noqa: E402
from gpu_parts.two_ranks import JOBS, ONE_PROCESS, TWO_RANKS_ONLY  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "measure", "gpu_check.py")
# The jobs of part "two_ranks" a CPU cannot run: FSDP2Trainer refuses cpu_offload without an accelerator, and the
# control's mesh is a CUDA one.
NO_ACCELERATOR = ("cpu offload", "cpu offload control")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("gpu_check")


@pytest.fixture(scope="module")
def dry_run(workdir) -> dict:
    """One whole dry run (about 5 minutes on 2 busy CPU cores; its workers are forked from one that imported once;
    part compile's whole-model compiles of the two peers take about a minute of it)."""
    command = [sys.executable, SCRIPT, "--dry-run", "--workdir", str(workdir)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(workdir / "gpu_dry_run.json") as f:
        return json.load(f)


def test_every_part_runs_and_only_cpu_offload_is_refused_on_the_cpu(dry_run):
    parts = dry_run["parts"]
    assert list(parts) == ["build", *gpu_check.PARTS]
    for name, part in parts.items():
        runs = part.get("runs", {})
        assert runs, name
        for run_name, run in runs.items():
            if run_name == "hf_fsdp2 AC cpu_offload":  # FSDP2Trainer refuses cpu_offload without an accelerator
                assert "cpu_offload=True moves shards from an accelerator" in run["error"]
            else:
                assert "error" not in run, (name, run_name, run["error"])


def test_compile_runs_each_system_compiled_by_its_own_switch_side_by_side(dry_run):
    """Part compile: FSDP2Config(compile=True) against Trainer and Trainer + Accelerate's plugin with
    TrainingArguments(torch_compile=True), the same sizes, in one table with ours over each."""
    runs = dry_run["parts"]["compile"]["runs"]
    assert list(runs) == ["hf_fsdp2 compile", "trainer compile", "accelerate compile"]
    assert {run["spec"]["system"] for run in runs.values()} == {"hf_fsdp2", "trainer", "accelerate"}
    assert all(run["spec"]["compile"] and run["tokens_per_s"] > 0 for run in runs.values())
    # on the CPU the peers' whole models compile on aot_eager (their inductor kernels are theirs); ours on inductor
    assert [run["spec"].get("backend") for run in runs.values()] == [None, "aot_eager", "aot_eager"]
    assert len({(run["spec"]["model"], run["spec"]["batch"], run["spec"]["seq"]) for run in runs.values()}) == 1
    table = gpu_check.render_markdown(dry_run)
    assert "| compiled, side by side (1B, 4 x 2048 tokens, bf16) |" in table and "| hf_fsdp2 compile ÷ this |" in table
    assert "| trainer compile |" in table and "| accelerate compile |" in table


def test_fp8_is_refused_by_name_on_the_cpu_and_its_bf16_reference_trains(dry_run):
    """Part fp8 on the CPU: FSDP2Trainer refuses float8=True by name (recorded as the run's outcome, not an error),
    Accelerate's FP8 is not tried, and our bf16 compiled run of the 3B's stand-in trains with activation
    checkpointing."""
    runs = dry_run["parts"]["fp8"]["runs"]
    assert list(runs) == ["hf_fsdp2 bf16 compile", "hf_fsdp2 fp8 compile", "accelerate fp8 compile"]
    ours = runs["hf_fsdp2 fp8 compile"]
    assert ours["status"] == "skipped: no CUDA" and "FP8 tensor cores" in ours["refused"]
    assert runs["accelerate fp8 compile"]["status"] == "skipped: no CUDA"
    reference = runs["hf_fsdp2 bf16 compile"]
    assert reference["spec"]["model"] == "m3b" and reference["spec"]["ac"] and reference["spec"]["compile"]
    assert len(reference["losses"]) == 8 and reference["tokens_per_s"] > 0
    assert dry_run["environment"]["models"]["m3b"]["inter"] == 1088  # torchao's filter takes its MLP
    table = gpu_check.render_markdown(dry_run)
    assert "| hf_fsdp2 fp8 compile | skipped: no CUDA |" in table and "| hf_fsdp2 bf16 compile |" in table


def test_offload_times_each_phase_and_the_hosts_adamw(dry_run):
    """Part offload: the on-GPU reference's steps split into phases that add up to the step, its last step
    profiled and left out of the median; AdamW on the host in its three implementations."""
    runs = dry_run["parts"]["offload"]["runs"]
    reference = runs["hf_fsdp2 AC"]
    for step in range(4):  # the 5th step runs under the profiler, which starts between the two marks
        phases = sum(reference["phases"][name][step] for name in ("forward_backward", "clip", "optimizer", "rest"))
        assert phases == pytest.approx(reference["step_s"][step], rel=0.2, abs=2e-3)
    assert set(reference["profiled"]) == {"h2d", "d2h", "other_device", "optimizer_host"}
    assert reference["profiled"]["optimizer_host"] > 0  # the profiler saw the optimizer's step
    assert len(reference["step_s"]) == 5 and reference["step_median_s"] == sorted(reference["step_s"][1:4])[1]
    host = runs["host adamw"]
    assert list(host["implementations"]) == ["fused", "foreach", "for-loop"] and host["params"] > 0
    table = gpu_check.render_markdown(dry_run)
    assert "| where a step goes (s, median) |" in table and "| fused |" in table


def test_the_cuda_only_tests_are_collected_and_skipped_on_the_cpu(dry_run):
    """Part "cuda_tests" runs pytest on the suite's CUDA-only tests: on the rehearsal they are found and skipped, so on
    a GPU the Muon bit-equality test is what runs (a test renamed or moved would leave the part empty: an error)."""
    tests = dry_run["parts"]["cuda_tests"]["runs"]["cuda tests"]["tests"]
    name = "tests.test_muon::test_on_cuda_newton_schulz_and_a_whole_step_are_bit_equal_to_torchs"
    assert tests == {name: "skipped: needs a CUDA device"}


def test_the_rehearsal_measures_what_the_gpu_run_reports(dry_run):
    parts = dry_run["parts"]
    ours, plain = parts["parity"]["runs"]["hf_fsdp2 fp32"], parts["parity"]["runs"]["trainer fp32"]
    assert max(abs(a - b) for a, b in zip(ours["losses"], plain["losses"], strict=True)) <= gpu_check.FP32_TOLERANCE
    assert ours["losses"][-1] < ours["losses"][0]  # the pattern data is learnt
    for run in parts["throughput"]["runs"].values():
        assert run["tokens_per_s"] > 0 and run["train_peak_mib"] is not None and len(run["step_s"]) == 4
    assert parts["generation"]["runs"]["generate"]["same_tokens"]  # gathered greedy decoding = the plain model's
    saved = parts["checkpoints"]["runs"]["checkpoints"]
    check_checkpoints(saved)
    planned = parts["planner"]["runs"]["planner"]["rows"]
    # every FSDP2Trainer training run outside parity but the refused offload one and the refused float8 one:
    # throughput 2, compile 1, fp8's bf16 1, qlora 2, long_rows 4, offload's on-GPU reference 1
    assert len(planned) == 2 + 1 + 1 + 2 + 4 + 1 and all(row["planned_mib"] > 0 for row in planned)
    table = gpu_check.render_markdown(dry_run)
    assert "| bf16 |" in table and "| fp32 | 0.00e+00 (within)" in table


def check_checkpoints(saved: dict) -> None:
    """Part "checkpoints" (issue 63): three spaced async saves and a back-to-back one, each with its blocked time in
    the save call and in the wait for its host copy, the copy of each part, and, from the second on, the previous
    save's host buffers reused (unpinned on the CPU); the back-to-back save waited for the last one's write inside
    its call; two sync saves (cached, then O_DIRECT) with DCP's stages; the disk's rates, and the sync saves and the
    cold resume as fractions of them."""
    spaced, back_to_back = saved["async_saves"], saved["async_back_to_back"]
    assert [s["step"] for s in spaced] == [3, 6, 9] and [s["step"] for s in back_to_back] == [10]
    for save in spaced + back_to_back:
        blocked = save["blocked_s"] + save["staging_wait_s"] + save.get("publish_s", 0.0)
        assert save["total_blocked_s"] == pytest.approx(blocked, abs=1e-3)
        assert len(save["copy_s"]) == 2 and save["pinned"] is False and save["written_s"] >= save["blocked_s"]
    assert [s["buffers_reused"] for s in spaced + back_to_back] == [None, True, True, True]
    assert all("wait_writes" not in s["stages"] for s in spaced)  # the last write was over before each of these
    # The back-to-back save waited for the last one's write in its call, unless that write (tiny here) was over by
    # the step's end, where every rank agreed so and published it (timed as that save's publish_s).
    published_before = spaced[-1].get("publish_s") is not None
    assert published_before or {"wait_writes", "commit"} <= set(back_to_back[0]["stages"])
    assert len(saved["async_step_s"]["after_each_save"]) == 4
    assert [s["writes"] for s in saved["sync_saves"]] == ["cached", "direct"]
    for save in saved["sync_saves"]:
        assert {"collect", "dcp_plan", "dcp_data", "dcp_fsync_summed", "dcp_finish", "files", "commit"} <= set(
            save["stages"]
        )
    rates = saved["disk_rates"]
    assert rates["bytes"] >= saved["rank_share_bytes"] > 0 and rates["write"] > 0 and rates["read_cold"] > 0
    assert saved["sync_save_cached_vs_disk_write"] > 0 and saved["sync_save_direct_vs_disk_write"] > 0
    assert saved["resume_vs_disk_read"] > 0 and saved["resume_s"] > 0 and saved["consolidated_bytes"] > 0
    table = gpu_check.render_markdown({"parts": {"checkpoints": {"status": "ok", "runs": {"checkpoints": saved}}}})
    assert "| back-to-back save 1, blocked |" in table and "| sync save (direct writes) |" in table


def test_two_ranks_hold_every_job_against_one_process(workdir, dry_run):
    """Part "two_ranks": every job at 2 ranks (gloo here, started by `torchrun -m hf_fsdp2.shared_device` as on a GPU)
    against the same job in one process, within its tolerance;
    fp32 within 1e-5 (measured: losses equal, weights 7.5e-9 apart, all of it the grad norm's sum over shards)."""
    runs = dry_run["parts"]["two_ranks"]["runs"]
    one = {name: run for name, run in runs.items() if name.endswith(ONE_PROCESS)}
    two = {name: run for name, run in runs.items() if not name.endswith(ONE_PROCESS)}
    assert list(one) == [job + ONE_PROCESS for job in JOBS if job not in TWO_RANKS_ONLY]
    assert list(two) == list(JOBS)
    for name, run in one.items():
        assert run.get("status", "ok") == ("skipped: no accelerator" if name == "cpu offload" + ONE_PROCESS else "ok")
    for name, run in two.items():
        assert (run["world"], run["backend"]) == (2, "gloo")
        if name in NO_ACCELERATOR:
            assert run["status"] == "skipped: no accelerator", run
            continue
        assert run["status"] == "ok", (name, run.get("error"))
        assert run["diffs"] and all(run["diffs"][k] <= run["tolerance"][k] for k in run["diffs"])
        assert run["checks"] == {} or all(run["checks"].values())
        if name != "grpo reward model":  # GRPO samples: its log-probs and reward-model scores are compared instead
            assert "losses" in run["diffs"] and any(k.startswith("weights") for k in run["diffs"]), name
    assert "cpu_offload=True moves shards from an accelerator" in two["cpu offload"]["refused"]
    fp32 = two["full fp32"]
    assert set(fp32["tolerance"].values()) == {gpu_check.FP32_TOLERANCE} and len(fp32["losses"]) == 4
    assert set(two["save resume consolidate"]["diffs"]) == {"losses", "weights (from_pretrained of the export)"}
    assert set(two["grpo reward model"]["diffs"]) == {"log-probs", "reward-model scores"}
    table = gpu_check.render_markdown(dry_run)
    assert "| job (2 ranks on gloo) | 2 ranks (one GPU) vs one process | tolerance | outcome |" in table
    with open(workdir / "log-two_ranks-two_ranks.txt") as f:  # started as on a GPU, not forked
        assert "--nproc_per_node 2 -m hf_fsdp2.shared_device" in f.readline()
    assert all(f"| {job} |" in table for job in JOBS)


def test_switches_skip_liger_without_cuda_and_train_fp16_on_the_cpu(dry_run):
    """Part "switches" on the CPU: both Liger runs skipped (FSDP2Trainer refuses by name; plain Trainer is not tried);
    our fp16 trains with a loss scale, within fp16's tolerance of plain Trainer(fp16=True), which computes in fp32 on a
    CPU (so the two differ: ours really computed in fp16)."""
    runs = dry_run["parts"]["switches"]["runs"]
    # one worker per system, Liger last in each (it patches transformers' Llama for the whole process)
    workers = ["hf_fsdp2 fp16", "hf_fsdp2 loss_chunk_size", "hf_fsdp2 liger", "trainer fp16", "trainer liger"]
    assert list(runs) == workers
    assert {name: run.get("status") for name, run in runs.items() if "status" in run or "error" in run} == {
        "hf_fsdp2 liger": "skipped: no CUDA",
        "trainer liger": "skipped: no CUDA",
    }
    assert "Liger's kernels are Triton kernels" in runs["hf_fsdp2 liger"]["refused"]
    assert "Triton has no CPU backend" in runs["trainer liger"]["refused"]
    ours, plain = runs["hf_fsdp2 fp16"], runs["trainer fp16"]
    assert ours["grad_scaler"] and not plain["grad_scaler"]  # Accelerate makes no scaler for fp16 on a CPU
    assert len(ours["losses"]) == 6 and all(math.isfinite(x) for x in ours["losses"]), ours["losses"]
    assert ours["losses"][-1] < ours["losses"][0] and ours["skipped_steps"] == []
    assert ours["loss_scales"] == [65536.0] * 6  # torch's initial scale, not yet grown (every 2000 steps)
    diff = max(abs(a - b) for a, b in zip(ours["losses"], plain["losses"], strict=True))
    assert 0 < diff <= FP16_REL_TOLERANCE * max(plain["losses"]), diff
    assert runs["hf_fsdp2 loss_chunk_size"]["tokens_per_s"] > 0
    table = gpu_check.render_markdown(dry_run)
    assert "| hf_fsdp2 liger | skipped: no CUDA |" in table and "| trainer liger | skipped: no CUDA |" in table
    assert "| hf_fsdp2 fp16 | fp16, scaled loss |" in table
    assert "| trainer fp16 | fp32 (no scaler, no autocast) |" in table


@pytest.mark.parametrize("system", ["hf_fsdp2", "trainer"])
def test_a_liger_run_on_a_gpu_without_liger_kernel_is_skipped_and_says_so(system, monkeypatch):
    monkeypatch.setattr(switches, "on_cuda", lambda: True)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # find_spec answers None: not installed
    record = switches.switched({"name": "liger", "system": system, "liger": True})
    assert record["status"] == "skipped: liger-kernel not installed" and "liger-kernel==" in record["fix"]


def test_a_part_that_would_not_fit_the_budget_is_skipped_and_says_so(tmp_path, monkeypatch):
    """With 80 s, 35 kept back for the planner: no part estimated above 45 s starts; the planner still runs."""
    ran = []
    monkeypatch.setattr(gpu_check, "run_workers", lambda args, env, part, runs, timeout: ran.append(part) or {})
    args = gpu_check.parse_args(["--budget-s", "80", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    results = gpu_check.run_check(args)
    assert ran == ["build", "collectives", "cuda_tests", "qlora", "planner"]  # 30-35 s each
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
