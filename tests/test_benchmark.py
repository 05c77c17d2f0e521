"""`scripts/benchmark/benchmark.py` keeps working: every system runs on a tiny model, they train the same, and the
tables, JSON and PNG come out. No timing is asserted; the pure report logic is checked on fixed numbers."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from tests.docs_blocks import marked_block
from tests.launch import ROOT

SCRIPTS = os.path.join(ROOT, "scripts", "benchmark")
sys.path[:0] = [SCRIPTS, os.path.join(ROOT, "scripts", "measure")]  # measure_file_rewrite, at the end

from benchmark import SYSTEMS  # noqa: E402
from benchmark_report import render_markdown, summarize  # noqa: E402

FSDP_SYSTEMS = (
    "hf_fsdp2",
    "hf_fsdp2_async",
    "accelerate_fsdp2",
    "transformers_fsdp2",
    "hf_fsdp2_lora",
    "hf_fsdp2_qlora",
)


def test_quick_benchmark_runs_every_system_and_they_train_the_same(tmp_path):
    out = tmp_path / "bench"
    command = [
        sys.executable,
        os.path.join(SCRIPTS, "benchmark.py"),
        "--quick",
        "--repeats",
        "1",
        "--steps",
        "4",
        "--layers",
        "1",
        "--hidden",
        "256",  # the QLoRA row's attention projections split into whole NF4 blocks at 2 ranks
        "--vocab",
        "128",
        "--seq-len",
        "16",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        f"{out}.json",
        "--png",
        f"{out}.png",
        "--markdown",
        f"{out}.md",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    summary, runs = result["summary"], result["runs"]
    assert list(summary["systems"]) == list(SYSTEMS)
    # The first system also ran once before the measured runs (a warm-up), and that run is not counted.
    assert (tmp_path / "work" / "result-hf_fsdp2-warmup.json").exists() and len(runs["hf_fsdp2"]) == 1
    # Same data, batch, seed and schedule: every system ends at DDP's loss, and resumes to the same next loss.
    assert all(diff < 1e-4 for diff in summary["loss_agreement"]["max_abs_diff"].values()), summary["loss_agreement"]
    resumed = {s: runs[s][0]["ranks"][0].get("loss_after_resume") for s in ("hf_fsdp2", "accelerate_fsdp2", "ddp")}
    assert max(resumed.values()) - min(resumed.values()) < 1e-4, resumed
    for system in FSDP_SYSTEMS:
        assert runs[system][0]["ranks"][0]["sharded_fraction"] == 1.0, system
    assert runs["ddp"][0]["ranks"][0]["sharded_fraction"] == 0.0
    # Our shards own their bytes; transformers' native loading leaves its weights views of the checkpoint file
    # (the performance page's account of its load time rests on this: if it fails, that account is out of date).
    views = {s: summary["systems"][s]["file_view_pct"]["median"] for s in ("hf_fsdp2", "transformers_fsdp2")}
    assert views["hf_fsdp2"] == 0 and views["transformers_fsdp2"] > 50, views
    # On a machine without accelerators the harness must have forced Accelerate's FSDP2 path, and say so.
    assert "forced its FSDP2 plugin" in summary["systems"]["accelerate_fsdp2"]["notes"]
    # Tied embedding written once: our checkpoint is no larger than Accelerate's.
    assert (
        summary["systems"]["hf_fsdp2"]["checkpoint_mib"]["median"]
        <= summary["systems"]["accelerate_fsdp2"]["checkpoint_mib"]["median"]
    )
    keys = ("load_s", "first_step_s", "ready_s", "load_peak_mib", "step_s", "save_s", "resume_s", "consolidate_s")
    for key in (*keys, "consolidate_peak_mib"):
        assert summary["systems"]["hf_fsdp2"][key]["median"] > 0, key
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "bench.md").read_text()
    assert "| metric | hf_fsdp2 | hf_fsdp2_async | accelerate_fsdp2 | transformers_fsdp2 | ddp |" in markdown
    assert "blocked save time with async_save" in markdown
    # The adapter rows: their own table against LoRA; QLoRA holds and gathers its NF4 weights in 4 bits.
    lora, qlora = summary["systems"]["hf_fsdp2_lora"], summary["systems"]["hf_fsdp2_qlora"]
    assert "| metric | hf_fsdp2_lora | hf_fsdp2_qlora |" in markdown
    assert qlora["base_mib"]["median"] < 0.8 * lora["base_mib"]["median"]
    assert 0 < qlora["gathered_mib"]["median"] < lora["gathered_mib"]["median"]
    assert qlora["memory"]["nf4_numel"] > 0 and "nf4_numel" in lora["memory"] and lora["memory"]["nf4_numel"] == 0
    targets = {row["target"]: row for row in summary["targets"]}
    assert targets["QLoRA: NF4 weights per rank ≤ 0.27× the same weights in bf16"]["met"] is True
    assert all(runs[s][0]["ranks"][0]["loss_after_resume"] for s in ("hf_fsdp2_lora", "hf_fsdp2_qlora"))

    rerendered = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "benchmark.py"), "--from-json", f"{out}.json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert rerendered.returncode == 0, rerendered.stderr[-3000:]
    assert markdown.strip() in rerendered.stdout


def _run(load_s: float, step_s: float, save_s: float, ckpt_mib: float, consolidate: tuple[float, float] | None) -> dict:
    rank = {
        "load_s": load_s,
        "load_peak_mib": 100.0,
        "step_s": [9.0, 9.0, step_s, step_s],
        "losses": [2.0, 1.5],
        "final_loss": 1.5,
        "save_s": [save_s, save_s],
        "train_peak_mib": 500.0,
        "resume_s": [0.5, 0.25],
        "signal_check_s": [0.002, 0.004, 0.003],
        "loss_after_resume": 1.4,
        "load_gpu_peak_mib": None,
        "train_gpu_peak_mib": None,
    }
    run = {"ranks": [rank, dict(rank, load_peak_mib=120.0)], "checkpoint_bytes": ckpt_mib * 2**20}
    if consolidate:
        run["consolidate"] = {"seconds": consolidate[0], "peak_mib": consolidate[1]}
    return run


def test_summary_ratios_and_targets_on_fixed_numbers():
    args = argparse.Namespace(
        warmup=2, batch=1, nproc=2, seq_len=64, hidden=64, layers=1, vocab=128, repeats=2, steps=4
    )
    runs = {
        "hf_fsdp2": [_run(2.0, 1.0, 2.0, 300, (1.0, 50)), _run(4.0, 1.2, 2.0, 300, (1.0, 50))],
        "hf_fsdp2_async": [_run(2.0, 1.0, 0.5, 300, None)] * 2,
        "accelerate_fsdp2": [_run(5.0, 1.0, 3.0, 400, (2.0, 300))] * 2,
    }
    summary = summarize(runs, args, model_bytes=200 * 2**20)
    ours = summary["systems"]["hf_fsdp2"]
    # Steady state leaves the warm-up steps out; the slowest rank and the worst rank count.
    assert ours["step_s"] == {"median": 1.1, "min": 1.0, "max": 1.2, "n": 2}
    assert ours["load_s"]["median"] == 3.0 and ours["load_peak_mib"]["median"] == 120.0
    assert ours["resume_s"]["median"] == 0.75
    # The first step (left out of step time) and load + first step: work a system deferred past loading shows here.
    assert ours["first_step_s"]["median"] == 9.0 and ours["ready_s"]["median"] == 12.0
    assert ours["tokens_per_s"]["max"] == 128.0
    targets = {row["target"]: row for row in summary["targets"]}
    assert targets["peak load RAM, worst rank ≤ 0.6× model"]["measured"] == pytest.approx(0.6)
    assert targets["peak load RAM, worst rank ≤ 0.6× model"]["met"] is True
    assert targets["training step time ≤ 1.0× accelerate_fsdp2"]["met"] is False  # 1.1 s against 1.0 s
    assert targets["load + first step ≤ 1.0× transformers_fsdp2"]["measured"] is None  # no such system here
    assert targets["checkpoint bytes ≤ accelerate_fsdp2's"]["measured"] == pytest.approx(0.75)
    assert targets["blocked save time with async_save ≤ 0.3× sync"]["measured"] == pytest.approx(0.25)
    assert targets["consolidation peak RAM ≤ 0.3× model"]["measured"] == pytest.approx(0.25)
    assert targets["consolidation time ≤ accelerate merge-weights"]["measured"] == pytest.approx(0.5)
    # 3 ms median check against a 1.1 s step
    assert targets["preemption check ≤ 1% of step time"]["measured"] == pytest.approx(0.003 / 1.1)
    markdown = render_markdown(summary)
    assert "| training step (steady state) (s) | 1.10 (1.00–1.20) **1.10×** |" in markdown
    assert "| training step time ≤ 1.0× accelerate_fsdp2 | 1.10× | **no** |" in markdown
    assert "| preemption check ≤ 1% of step time | 0.0027× | yes |" in markdown
    assert "| preemption check (SIGTERM agreement), per step (ms) | 3.000 " in markdown


def test_a_failed_rank_stops_the_others_and_its_output_is_raised(tmp_path):
    from benchmark_runs import _run_ranks

    script = tmp_path / "rank.py"
    # rank 1 fails at once; rank 0 would wait 60 s (as in a collective its peer never joins)
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('rank 1 broke')\ntime.sleep(60)\n"
    )
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 \(exit 1\).*rank 1 broke"):
        _run_ranks([sys.executable, str(script)], 2, str(tmp_path / "none.json"))
    assert time.perf_counter() - started < 30


def test_ranks_start_the_clock_together_after_a_slow_import(tmp_path):
    from benchmark_runs import _run_ranks

    script = tmp_path / "rank.py"
    # rank 1 "imports" 1.5 s longer; each rank then records when it passed start_together()
    script.write_text(
        f"import json, os, sys, time\nsys.path.insert(0, {SCRIPTS!r})\n"
        "from benchmark_worker import start_together\n"
        "if os.environ['RANK'] == '1':\n    time.sleep(1.5)\n"
        "start_together()\n"
        f"json.dump(time.time(), open(os.path.join({str(tmp_path)!r}, os.environ['RANK'] + '.json'), 'w'))\n"
    )
    _run_ranks([sys.executable, str(script)], 2, str(tmp_path / "0.json"))
    passed = [json.load(open(tmp_path / name)) for name in ("0.json", "1.json")]
    assert abs(passed[0] - passed[1]) < 0.3  # rank 0 waited for rank 1 before its clock would start


@pytest.mark.parametrize("fresh", ["0", "1"])
def test_a_rank_runs_its_script_with_its_own_environment_forked_or_fresh(tmp_path, fresh):
    """A forked rank (the default without an accelerator) starts with the workers' modules already imported and
    runs the script as `python script args` would: its own argv, environment and output; a fresh one imports.
    Driven from a process of its own, as the benchmark is (this one's fork server is the suite's, tests/launch)."""
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import json, os, sys\n"
        "print(json.dumps([sys.argv[1:], os.environ['RANK'], 'benchmark_systems' in sys.modules, __name__]))\n"
        "sys.exit(3)\n"
    )
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import os, sys\nsys.path.insert(0, {SCRIPTS!r})\nimport forked_ranks\n"
        "if __name__ == '__main__':\n"
        f"    handle = forked_ranks.start([sys.executable, {str(rank)!r}, 'a', 'b'], {{**os.environ, 'RANK': '7'}},\n"
        f"                                {str(tmp_path / 'out.log')!r})\n"
        "    print('exit', handle.wait(), handle.returncode)\n"
    )
    env = {**os.environ, "BENCHMARK_FRESH_PROCESSES": fresh}
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=300, env=env)
    assert "exit 3 3" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    argv, rank_env, preloaded, name = json.loads((tmp_path / "out.log").read_text().strip().splitlines()[-1])
    assert (argv, rank_env, name) == (["a", "b"], "7", "__main__")
    assert preloaded is (fresh == "0")


PERFORMANCE_PAGE = os.path.join(ROOT, "docs", "performance.md")


def docs_block(name: str) -> str:
    """The performance page's text between <!-- NAME:begin --> and <!-- NAME:end -->."""
    return marked_block("performance.md", name)


def test_docs_performance_tables_are_the_committed_measurement():
    """The performance page's benchmark tables are rendered from scripts/results/benchmark_quick.json, never typed:
    re-render with `python scripts/benchmark/benchmark.py --from-json scripts/results/benchmark_quick.json`."""
    with open(os.path.join(ROOT, "scripts", "results", "benchmark_quick.json")) as f:
        summary = json.load(f)["summary"]
    block = docs_block("benchmark")
    assert block.strip() == render_markdown(summary).strip()


def test_docs_long_context_table_is_the_committed_measurement():
    """The performance page's sequence-parallelism table is rendered from scripts/results/long_context.json, never
    typed: re-render with
    `python scripts/benchmark/benchmark.py --long-context --from-json scripts/results/long_context.json`."""
    from benchmark_long_context import render_markdown as render_long_context

    with open(os.path.join(ROOT, "scripts", "results", "long_context.json")) as f:
        saved = json.load(f)
    block = docs_block("long-context")
    assert block.strip() == render_long_context(saved).strip()


def test_sweep_sets_each_phase_against_its_physical_limit_on_fixed_numbers():
    """Limits are the phase's bytes at the measured rates; the table gives seconds, x limit and our ratio."""
    from benchmark_sweep import add_limits, phase_bytes, render_markdown, slowest_steps

    gib = 2**30
    rates = {"disk_write": 1 * gib, "cached_read": 4 * gib, "memory_copy": 8 * gib}
    assert phase_bytes(gib, 3 * gib) == {
        "load_s": (gib, 0), "save_s": (0, 3 * gib), "resume_s": (3 * gib, 0), "consolidate_s": (gib, gib),
    }  # fmt: skip
    ours = {"load_s": 0.5, "save_s": 6.0, "resume_s": 1.5, "consolidate_s": 2.5, "checkpoint_bytes": 3 * gib}
    peer = {"load_s": 1.0, "save_s": 3.0, "resume_s": 3.0, "consolidate_s": 5.0, "checkpoint_bytes": 3 * gib}
    ours["step_s"], peer["step_s"] = 2.0, 2.5  # no byte limit: seconds only
    ours["ready_s"], peer["ready_s"] = 3.0, 4.0
    results = {"1G": {"model_bytes": gib, "notes": ["1G: ddp left out"], "systems": {"hf_fsdp2": ours}}}
    results["1G"]["systems"].update({"accelerate_fsdp2": dict(peer), "transformers_fsdp2": dict(peer)})
    add_limits(results, rates)
    assert ours["load_s_limit"] == 0.25 and ours["load_s_x_limit"] == 2.0  # 1 GiB read at 4 GiB/s
    assert ours["save_s_limit"] == 3.0 and ours["consolidate_s_limit"] == 1.25
    markdown = render_markdown({"rates": rates, "nproc": 2, "results": results})
    assert "| 1G | 1024 | 0.50 (2.0x) | 1.00 (4.0x) | 1.00 (4.0x) | **0.50x** |" in markdown  # load vs native
    assert "| 1G | 1024 | 6.00 (2.0x) | 3.00 (1.0x) | 3.00 (1.0x) | **2.00x** |" in markdown  # save vs Accelerate
    assert "| 1G | 1024 | 2.00 | 2.50 | 2.50 | **0.80x** |" in markdown  # step vs Accelerate
    assert (
        "| load + first step | model MiB |" in markdown and "| 1G | 1024 | 3.00 | 4.00 | 4.00 | **0.75x** |" in markdown
    )
    assert "step_s_limit" not in ours and "1G: ddp left out" in markdown
    # Results saved before the schedule was recorded in the JSON were 3 steps, 1 of them warm-up.
    assert "step: the median of steps 2 to 3, after 1 warm-up step;" in markdown
    results["1G"].update(steps=6, warmup=3)
    assert "step: the median of steps 4 to 6, after 3 warm-up steps;" in render_markdown(
        {"rates": rates, "nproc": 2, "results": results}
    )
    # Rates measured for a size (with a file of its model bytes) are that size's yardstick.
    slow = {"disk_write": 0.5 * gib, "cached_read": 2 * gib, "memory_copy": 8 * gib}
    big = {"consolidate_s": 9.0, "checkpoint_bytes": 4 * gib}
    sized = {"4G": {"model_bytes": 4 * gib, "rates": slow, "notes": [], "systems": {"hf_fsdp2": big}}}
    add_limits(sized)
    assert big["consolidate_s_limit"] == 10.0 and big["consolidate_s_x_limit"] == 0.9  # 4 GiB read at 2, written at 0.5
    markdown = render_markdown({"nproc": 2, "results": sized})
    assert "4G (4096 MiB files): disk write (fsync'd) 0.50, cached read 2.00" in markdown
    # Rates measured both ways name both writers; the limit takes the faster.
    slow.update(disk_write_buffered=0.25 * gib, disk_write_direct=0.5 * gib)
    both = render_markdown({"nproc": 2, "results": sized})
    assert "disk write (fsync'd) 0.50 (buffered 0.25, O_DIRECT 0.50), cached read 2.00" in both
    # A load's bytes land in new memory: where copying into new memory is slower than the cached read, that is
    # its limit; a resume (into tensors that exist) keeps the cached read.
    copy_bound = {"disk_write": 1 * gib, "cached_read": 4 * gib, "memory_copy": 2 * gib}
    figures = {"load_s": 1.0, "resume_s": 1.0, "checkpoint_bytes": gib}
    add_limits({"1G": {"model_bytes": gib, "rates": copy_bound, "systems": {"hf_fsdp2": figures}}})
    assert figures["load_s_limit"] == 0.5 and figures["resume_s_limit"] == 0.25
    assert "a load's bytes land in new memory, so at the slower of cached read and memory copy" in markdown
    # the step time: each step's slowest rank, warm-up left out
    assert slowest_steps([{"step_s": [9.0, 1.0, 3.0]}, {"step_s": [8.0, 2.0, 1.0]}], warmup=1) == [2.0, 3.0]


def test_disk_yardstick_is_the_faster_of_buffered_and_o_direct_writes(tmp_path):
    """The disk write rate is measured both ways, on a real file, and the limit uses the faster."""
    from benchmark_sweep import measure_bandwidth

    rates = measure_bandwidth(str(tmp_path), 1 << 24)
    assert rates["disk_write"] == max(rates["disk_write_buffered"], rates.get("disk_write_direct", 0.0)) > 0
    assert os.listdir(tmp_path) == []  # the yardstick files are removed


def test_sweep_trains_with_sgd_and_leaves_out_what_would_not_fit(monkeypatch):
    import benchmark_sweep

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 24 * 2**30 // 4096}
    monkeypatch.setattr(benchmark_sweep.os, "sysconf", lambda name: pages[name])
    optim, systems, notes = benchmark_sweep.plan_size("100M", list(benchmark_sweep.SYSTEMS), 2)
    assert optim == "adamw" and systems == list(benchmark_sweep.SYSTEMS) and not notes
    optim, systems, notes = benchmark_sweep.plan_size("1.2B", list(benchmark_sweep.SYSTEMS), 2)
    assert optim == "sgd" and "ddp" not in systems and "hf_fsdp2" in systems
    assert any("SGD" in n for n in notes) and any("ddp left out" in n for n in notes)


def test_sweep_runs_a_tiny_size_end_to_end(tmp_path):
    """The sweep's own path (sizes, runs, consolidation, limits, table, PNG) on a 2 x 64 Llama (hf_fsdp2 only: the
    other systems' runs are the quick benchmark's, tested above)."""
    out = tmp_path / "sweep.json"
    command = [sys.executable, os.path.join(SCRIPTS, "benchmark.py"), "--sweep", "--sizes", "2x64",
               "--systems", "hf_fsdp2", "--workdir", str(tmp_path / "work"), "--json", str(out),
               "--png", str(tmp_path / "sweep.png")]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    figures = saved["results"]["2x64"]["systems"]
    for phase in ("load_s", "save_s", "resume_s", "consolidate_s"):
        assert figures["hf_fsdp2"][phase] > 0 and figures["hf_fsdp2"][f"{phase}_x_limit"] > 0
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert "hf_fsdp2 vs transformers_fsdp2" in proc.stdout


def test_docs_size_sweep_table_is_the_committed_measurement():
    """The performance page's size-sweep table is rendered from scripts/results/sweep.json, never typed: re-render with
    `python scripts/benchmark/benchmark.py --sweep --from-json scripts/results/sweep.json`."""
    from benchmark_sweep import render_markdown as render_sweep

    with open(os.path.join(ROOT, "scripts", "results", "sweep.json")) as f:
        saved = json.load(f)
    block = docs_block("sweep")
    assert block.strip() == render_sweep(saved).strip()


@pytest.mark.parametrize("name", ["sweep", "sweep_repeat", "sweep_store", "sweep_small"])
def test_docs_sweep_ratios_are_the_committed_sweeps(name):
    """Each sweep's row of ratios on the performance page (hf_fsdp2 against its peer per phase, per size) is what its
    JSON holds: `python scripts/benchmark/benchmark.py --sweep --from-json scripts/results/NAME.json` prints the same
    seconds."""
    from benchmark_sweep import PEERS
    from benchmark_sweep import render_markdown as render_sweep

    with open(os.path.join(ROOT, "scripts", "results", f"{name}.json")) as f:
        saved = json.load(f)
    assert render_sweep(saved)  # still renders
    cells = [
        "/".join(f"{s['systems']['hf_fsdp2'][p] / s['systems'][PEERS[p]][p]:.2f}" for s in saved["results"].values())
        for p in ("load_s", "ready_s", "save_s", "resume_s", "consolidate_s", "step_s")
    ]
    rows = [line for line in open(PERFORMANCE_PAGE).read().splitlines() if f"| `{name}.json` |" in line]
    assert len(rows) == 1, rows
    assert rows[0].endswith(f"| `{name}.json` | " + " | ".join(cells) + " |"), (rows[0], cells)


def test_a_checkpoint_rewritten_in_place_reaches_every_weight_of_transformers_native_fsdp2():
    """The safety step the performance page gives for our load time, measured on the peer
    (scripts/measure/measure_file_rewrite.py): native FSDP2 leaves weights as private maps of the file, so zeroing its
    bytes in place zeroes every weight; ours copies the rows (tests/test_loading_distributed.py pins that). The
    script's other rewrite (the file cut short: SIGBUS) is left to it: another 2-rank launch."""
    from measure_file_rewrite import main

    args = ["--layers", "1", "--hidden", "64", "--vocab", "256", "--systems", "transformers_fsdp2", "--modes", "zero"]
    assert main(args)["transformers_fsdp2"]["zero"]["changed_pct"] > 99.9
