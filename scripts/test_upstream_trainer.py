"""transformers' own Trainer tests, run twice: against plain `transformers.Trainer` (control) and with `Trainer`
replaced by `hf_fsdp2.FSDP2Trainer` (ours). The number that matters: of the tests that pass with plain Trainer, how
many pass with ours; every one that does not is listed, with the reason from `KNOWN_DIFFERENCES` below.

The tests are not part of the transformers wheel or sdist: `--tests-dir` is a transformers checkout's `tests/`
folder, at the tag of the installed release (`git clone --depth 1 --branch v5.24.0
https://github.com/huggingface/transformers`). Each side is one pytest process on that checkout (cwd: the checkout,
so `tests.trainer` imports as a package), with `-p upstream_trainer_plugin` (`scripts/upstream_trainer_plugin.py`):
on our side it rebinds `transformers.Trainer` and `transformers.trainer.Trainer` to FSDP2Trainer before any test
module is imported; on both sides it records which tests build a Trainer at all. FSDP2Trainer runs as one plain
process (a world of one, no torchrun), as in tests/test_parity.py. Both sides get the same environment:
HF_HUB_OFFLINE=1 unless `--online` (this project's machines reach no hub: a test that downloads a model fails on both
sides and so is not counted), OMP_NUM_THREADS=1, the same PYTHONPATH.

Default files (`DEFAULT_FILES`), the single-process Trainer tests that build trainers on the CPU:
- test_trainer.py: training, gradient accumulation and checkpointing, NEFTune, logging, metrics, model_init,
  early stopping, torch.compile;
- test_trainer_checkpointing.py: saving, resuming (frozen parameters, accumulation, batch size changes), rotation,
  best model, JIT checkpoints (its hub tests are staging tests and skip);
- test_trainer_evaluation.py: evaluate, predict, batched metrics;
- test_trainer_data.py: dataloaders, iterable datasets, dynamic shapes (and samplers and collators, which need no
  trainer: the table counts the tests that build one apart);
- test_trainer_accelerator.py: AcceleratorConfig reaching the trainer's Accelerator;
- test_trainer_optimizers.py: optimizers and schedulers (a user's optimizer, Adafactor, ReduceLROnPlateau,
  weight-decay groups, bitsandbytes; most optional-package optimizers need a GPU and skip on a CPU).
Left out: tests/trainer/distributed/ and the *_distributed*, *_fsdp*, *_context_parallel*, *_tpu*, deepspeed files
(several processes, GPUs or DeepSpeed); test_trainer_seq2seq.py (hub models; Seq2SeqTrainer's base is bound
before the plugin could swap it); test_trainer_hyperparameter.py (optuna/ray/wandb); test_trainer_utils.py,
test_data_collator.py, test_training_args.py (no trainer is built). test_trainer_callback.py belongs in the
selection, but the only copy at hand when this was first run predates the split of test_trainer.py and imports
helpers that moved to trainer_test_utils.py; pass it (or any other file) as an argument to add it.

The checkout's test requirements must be installed: `pip install parameterized` (test_trainer_optimizers.py
imports it); datasets, accelerate and peft are the package's own.

The committed results (`scripts/results/upstream_trainer.json`) were run on copies of the upstream files at the
commits the JSON names, not on a clone (none was at hand); its `notes` list the one local edit.

Usage:
    python scripts/test_upstream_trainer.py --tests-dir ~/transformers/tests [FILES...] [-k EXPR]
        [--json scripts/results/upstream_trainer.json] [--upstream-commit trainer/test_trainer.py=SHA ...]
    python scripts/test_upstream_trainer.py --from-json scripts/results/upstream_trainer.json   # the docs table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
DEFAULT_JSON = os.path.join(SCRIPTS, "results", "upstream_trainer.json")
DEFAULT_FILES = (
    "trainer/test_trainer.py",
    "trainer/test_trainer_checkpointing.py",
    "trainer/test_trainer_evaluation.py",
    "trainer/test_trainer_data.py",
    "trainer/test_trainer_accelerator.py",
    "trainer/test_trainer_optimizers.py",
)
SIDES = ("control", "ours")

# Test id -> why it passes with Trainer and not with FSDP2Trainer. Each is a deliberate difference, listed in
# docs/full-finetuning.md ("Differences from Trainer that stay"); a miss missing here is printed as UNEXPLAINED.
_JIT = (
    "enable_jit_checkpoint=True is refused at construction: checkpoint on SIGTERM is "
    "FSDP2Config(checkpoint_on_signals=...), which every rank agrees on"
)
_BNB_8BIT = (
    "optim= a bitsandbytes 8-bit optimizer is refused at construction: its blockwise-quantised state cannot be "
    "sharded exactly (optim='adamw_torch_8bit' or the 32-bit variant instead)"
)
_DCP = (
    "reads checkpoint-N/model.safetensors: FSDP2Trainer's checkpoints are sharded DCP folders "
    "(pytorch_model_fsdp_0/, optimizer_0/); `hf-fsdp2 consolidate` makes the safetensors folder"
)
KNOWN_DIFFERENCES: dict[str, str] = {
    **{
        f"test_trainer_checkpointing.py::JITCheckpointTest::{name}": _JIT
        for name in (
            "test_checkpoint_manager_initialization",
            "test_execute_jit_checkpoint",
            "test_execute_jit_checkpoint_sentinel_file_cleanup",
            "test_execute_jit_checkpoint_with_exception",
            "test_integration_with_trainer",
            "test_jit_checkpoint_callback_on_epoch_end",
            "test_jit_checkpoint_callback_on_pre_optimizer_step",
            "test_jit_checkpoint_callback_on_step_begin",
            "test_jit_checkpoint_callback_on_step_end",
            "test_jit_checkpoint_callback_on_train_end",
            "test_jit_checkpoint_callback_set_trainer_enabled",
            "test_kill_wait_period",
            "test_signal_handler_setup",
            "test_sigterm_handler_flow",
            "test_toggle_checkpoint_flag",
        )
    },
    "test_trainer_checkpointing.py::TrainerCheckpointSaveTest::test_save_checkpoints": _DCP,
    "test_trainer_checkpointing.py::TrainerResumeTrainingTest::test_resume_training_with_checkpoint": (
        _DCP + " (the test rewrites it as a sharded safetensors checkpoint before resuming)"
    ),
    "test_trainer_checkpointing.py::TrainerResumeTrainingTest::test_resume_training_with_shard_checkpoint": (
        _DCP + " (the test rewrites it as a sharded safetensors checkpoint before resuming)"
    ),
    "test_trainer_checkpointing.py::TrainerInterruptedTrainingTest::test_resume_from_interrupted_training": _DCP,
    "test_trainer_checkpointing.py::TrainerInterruptedTrainingTest::test_resume_batch_order": (
        _DCP + "; also its model overrides load_state_dict(state_dict, strict) without `assign`, which "
        "torch.distributed.checkpoint's set_model_state_dict passes when an in-memory model is sharded"
    ),
    "test_trainer_checkpointing.py::TrainerBestModelTest::test_save_best_checkpoint": (
        "counts the entries of output_dir: FSDP2Trainer also writes the consolidated model there at the end of "
        "train() (FSDP2Config(consolidate_on_train_end=False) turns it off)"
    ),
    "test_trainer_optimizers.py::TrainerOptimizerIntegrationTest::test_bnb_8bit_optimizer_skip_embedding": _BNB_8BIT,
    "test_trainer_optimizers.py::TrainerOptimizerIntegrationTest::test_bnb_optim_2_ademamix_8bit": _BNB_8BIT,
    "test_trainer_optimizers.py::TrainerOptimizerIntegrationTest::test_bnb_optim_3_rmsprop_bnb_8bit": _BNB_8BIT,
    "test_trainer.py::TrainerGradientCheckpointingTest::test_gradient_checkpointing": (
        "torch.allclose on two parameters: they are DTensors (shards) under FSDP2, and DTensor has no allclose "
        "(`p.full_tensor()` gives the whole value); the training itself ran"
    ),
    "test_trainer.py::TrainerNEFTuneTest::test_neftune": (
        "calls the input-embedding submodule directly, outside the model's forward: its weight is a DTensor "
        "shard there (`hf_fsdp2.gathered(model)` gathers it); NEFTune in training works"
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help=f"test files under --tests-dir (default: {' '.join(DEFAULT_FILES)})")
    parser.add_argument("--tests-dir", help="a transformers checkout's tests/ folder")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression, for both sides")
    parser.add_argument("--json", default=DEFAULT_JSON, help="where to write the results (default: %(default)s)")
    parser.add_argument("--no-json", action="store_true", help="write no results file")
    parser.add_argument(
        "--upstream-commit",
        action="append",
        default=[],
        metavar="FILE=SHA",
        help="record the commit a file was taken from (for a tests dir that is not a git checkout); repeatable",
    )
    parser.add_argument(
        "--note", action="append", default=[], help="a line recorded in the results, e.g. a local edit; repeatable"
    )
    parser.add_argument("--online", action="store_true", help="let tests reach the hub (default: HF_HUB_OFFLINE=1)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per side (default: %(default)s)")
    parser.add_argument("--from-json", default=None, help="print the markdown tables of a results file, run nothing")
    args = parser.parse_args(argv)
    if args.from_json is None and args.tests_dir is None:
        parser.error("--tests-dir is required (or --from-json)")
    return args


def run_side(side: str, tests_dir: str, files: list[str], keyword: str | None, online: bool, timeout: int) -> dict:
    """One pytest process for one side; returns its per-test outcomes and wall time."""
    checkout = os.path.dirname(os.path.abspath(tests_dir))
    tests_name = os.path.basename(os.path.abspath(tests_dir))
    env = dict(os.environ)
    env.update(
        UPSTREAM_TRAINER_SIDE=side,
        TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (SCRIPTS, REPO, env.get("PYTHONPATH")) if p),
    )
    if not online:
        env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", *(os.path.join(tests_name, f) for f in files)]
        command += ["-p", "upstream_trainer_plugin", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rN"]
        command += ["--rootdir", checkout, "--junitxml", junit, "-o", "junit_family=xunit1"]
        if keyword:
            command += ["-k", keyword]
        print(f"[{side}] {' '.join(command[2:])}", flush=True)
        start = time.monotonic()
        proc = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.monotonic() - start
        if not os.path.exists(junit):
            sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
            raise SystemExit(f"[{side}] pytest wrote no report (exit code {proc.returncode})")
        tests = parse_junit(junit, checkout)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"[{side}] {summary} ({wall:.0f} s)", flush=True)
    return {"wall_s": round(wall, 1), "exit_code": proc.returncode, "pytest_summary": summary, "tests": tests}


def parse_junit(path: str, checkout: str) -> dict[str, dict]:
    """Test id (`file.py::Class::test`, `file.py::test` outside a class) -> outcome, its message's first line, and
    whether it built a Trainer."""
    tests: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        # classname: the module's dotted name from the checkout, then the class (none outside a class). Not the
        # `file` attribute: for a test skipped by a decorator it names unittest's case.py.
        dotted = case.get("classname", "").split(".")
        split = next(
            (i for i in range(len(dotted), 0, -1) if os.path.isfile(os.path.join(checkout, *dotted[:i]) + ".py")),
            len(dotted),
        )
        test_id = "::".join(
            part for part in (dotted[split - 1] + ".py", ".".join(dotted[split:]), case.get("name")) if part
        )
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (element.get("message") or "").strip().splitlines()[0][:300] if element.get("message") else ""
                break
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests[test_id] = {
            "outcome": outcome,
            "message": message,
            "builds_trainer": properties.get("builds_trainer") == "True",
        }
    return tests


def counts(tests: dict[str, dict]) -> dict[str, int]:
    result = {"collected": len(tests)}
    for outcome in ("passed", "failed", "error", "skipped"):
        result[outcome] = sum(t["outcome"] == outcome for t in tests.values())
    return result


def compare(control: dict[str, dict], ours: dict[str, dict]) -> dict[str, Any]:
    """The control's passes, ours among them, and each miss with its reason."""
    passing = sorted(t for t, r in control.items() if r["outcome"] == "passed")
    kept = [t for t in passing if ours.get(t, {}).get("outcome") == "passed"]
    misses = []
    for test_id in passing:
        if test_id in kept:
            continue
        result = ours.get(test_id, {"outcome": "missing", "message": "", "builds_trainer": False})
        misses.append(
            {
                "test": test_id,
                "ours": result["outcome"],
                "message": result["message"],
                "reason": KNOWN_DIFFERENCES.get(test_id, "UNEXPLAINED"),
            }
        )
    trainer_tests = [t for t in passing if control[t]["builds_trainer"]]
    return {
        "control_passed": len(passing),
        "ours_passed_of_those": len(kept),
        "control_passed_building_a_trainer": len(trainer_tests),
        "ours_passed_of_those_building_a_trainer": sum(t in kept for t in trainer_tests),
        "misses": misses,
        "ours_only_passed": sorted(
            t for t, r in ours.items() if r["outcome"] == "passed" and control.get(t, {}).get("outcome") != "passed"
        ),
    }


def upstream_commits(tests_dir: str, files: list[str], given: list[str]) -> dict[str, str]:
    """Each file's commit: from --upstream-commit, else the checkout's HEAD (`git describe` too), else unknown."""
    commits = dict(item.split("=", 1) for item in given)
    head = subprocess.run(
        ["git", "-C", tests_dir, "describe", "--tags", "--always", "--long"], capture_output=True, text=True
    )
    for file in files:
        commits.setdefault(file, head.stdout.strip() if head.returncode == 0 else "unknown")
    return commits


def versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "hf_fsdp2"], capture_output=True, text=True)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "python": sys.version.split()[0],
        "hf_fsdp2_commit": commit,
        "hf_fsdp2_uncommitted_changes": bool(changed.stdout.strip()),
    }


def counts_markdown(results: dict) -> str:
    """Each side's counts and the comparison: the block between `<!-- upstream-trainer:begin/end -->` in
    docs/full-finetuning.md (tests/test_readme.py compares the two)."""
    comparison, sides = results["comparison"], results["sides"]
    lines = [
        "| side | collected | passed | failed | errors | skipped | run time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for side, label in (("control", "plain `Trainer`"), ("ours", "`FSDP2Trainer`")):
        c = sides[side]["counts"]
        lines.append(
            f"| {label} | {c['collected']} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} "
            f"| {sides[side]['wall_s']:.0f} s |"
        )
    passed, kept = comparison["control_passed"], comparison["ours_passed_of_those"]
    lines += [
        "",
        f"Of the {passed} tests that pass with plain `Trainer`, **{kept} pass with `FSDP2Trainer`**.",
        f"{comparison['control_passed_building_a_trainer']} of the {passed} build a trainer (the others test "
        f"samplers, collators and other helpers), and {comparison['ours_passed_of_those_building_a_trainer']} of "
        "those pass.",
        f"Each of the {passed - kept} others meets a difference from the table above:",
    ]
    return "\n".join(lines)


def misses_markdown(results: dict) -> str:
    """The tests that pass with plain Trainer only, grouped by reason."""
    lines = ["| passes with `Trainer` only | why |", "|---|---|"]
    by_reason: dict[str, list[str]] = {}
    for miss in results["comparison"]["misses"]:
        by_reason.setdefault(miss["reason"], []).append(miss["test"])
    for reason, tests in by_reason.items():
        # The shared prefix (file, or file::Class) once, then each test's own part.
        parts = [t.split("::") for t in tests]
        depth = 2 if all(p[:2] == parts[0][:2] for p in parts) else 1 if all(p[0] == parts[0][0] for p in parts) else 0
        names = ", ".join(f"`{'::'.join(p[depth:])}`" for p in parts)
        if depth:
            names = f"`{'::'.join(parts[0][:depth])}`" + (f" ({len(tests)}): " if len(tests) > 1 else ": ") + names
        lines.append(f"| {names} | {reason} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    return counts_markdown(results) + "\n\n" + misses_markdown(results)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f)))
        return
    files = args.files or list(DEFAULT_FILES)
    missing = [f for f in files if not os.path.isfile(os.path.join(args.tests_dir, f))]
    if missing:
        raise SystemExit(f"not in {args.tests_dir}: {', '.join(missing)}")
    sides = {}
    for side in SIDES:
        sides[side] = run_side(side, args.tests_dir, files, args.keyword, args.online, args.timeout)
        sides[side]["counts"] = counts(sides[side]["tests"])
    comparison = compare(sides["control"]["tests"], sides["ours"]["tests"])
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "upstream_commits": upstream_commits(args.tests_dir, files, args.upstream_commit),
        "files": files,
        "notes": args.note,
        "keyword": args.keyword,
        "hub": "online" if args.online else "offline (HF_HUB_OFFLINE=1)",
        "machine_cpus": os.cpu_count(),
        "comparison": comparison,
        "sides": {
            side: {
                "wall_s": data["wall_s"],
                "exit_code": data["exit_code"],
                "counts": data["counts"],
                "outcomes": {t: r["outcome"] for t, r in sorted(data["tests"].items())},
                # Why each failure or error failed: its message's first line.
                "messages": {
                    t: r["message"] for t, r in sorted(data["tests"].items()) if r["outcome"] in ("failed", "error")
                },
            }
            for side, data in sides.items()
        },
    }
    print()
    print(markdown(results))
    unexplained = [m["test"] for m in comparison["misses"] if m["reason"] == "UNEXPLAINED"]
    if unexplained:
        print(f"\n{len(unexplained)} miss(es) without a reason in KNOWN_DIFFERENCES: {', '.join(unexplained)}")
    if not args.no_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
