"""scripts/test_upstream_trainer.py: transformers' Trainer tests against FSDP2Trainer. Its committed run is the
docs' table, every miss of it has a reason, and the harness swaps `Trainer` on one side only (on a stand-in tests
folder: transformers' own tests are not in its wheel)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

from tests.docs_blocks import marked_block
from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import test_upstream_trainer as harness  # noqa: E402

RESULTS = os.path.join(ROOT, "scripts", "results", "upstream_trainer.json")


def test_docs_table_is_the_committed_run():
    """Re-render with `python scripts/test_upstream_trainer.py --from-json scripts/results/upstream_trainer.json`."""
    with open(RESULTS) as f:
        results = json.load(f)
    assert marked_block("full-finetuning.md", "upstream-trainer").strip() == harness.counts_markdown(results).strip()


def test_every_miss_of_the_committed_run_has_a_reason_and_every_reason_a_miss():
    with open(RESULTS) as f:
        misses = {m["test"]: m["reason"] for m in json.load(f)["comparison"]["misses"]}
    assert "UNEXPLAINED" not in misses.values()
    assert set(misses) == set(harness.KNOWN_DIFFERENCES)


STAND_IN = """
import torch
from torch import nn
from transformers import Trainer, TrainingArguments


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, input_x, labels=None):
        y = self.linear(input_x)
        return (nn.functional.mse_loss(y, labels), y)


def make(tmp_path):
    return Trainer(Tiny(), TrainingArguments(str(tmp_path), report_to=[], use_cpu=True))


def test_helper_without_trainer():
    assert 1 + 1 == 2


def test_parameters_are_plain_tensors(tmp_path):
    assert type(make(tmp_path).model.linear.weight) is nn.Parameter


def test_class_name_is_kept(tmp_path):
    assert make(tmp_path).__class__.__name__.endswith("Trainer")


def test_fails_on_both_sides():
    raise AssertionError("fails alike")
"""


def test_the_harness_swaps_trainer_on_our_side_only(tmp_path):
    tests_dir = tmp_path / "checkout" / "tests"
    (tests_dir / "trainer").mkdir(parents=True)
    (tests_dir / "__init__.py").write_text("")
    (tests_dir / "trainer" / "__init__.py").write_text("")
    (tests_dir / "trainer" / "test_stand_in.py").write_text(textwrap.dedent(STAND_IN))
    out = tmp_path / "results.json"
    harness.main(["--tests-dir", str(tests_dir), "trainer/test_stand_in.py", "--json", str(out)])
    results = json.loads(out.read_text())

    control, ours = (results["sides"][side]["outcomes"] for side in ("control", "ours"))
    assert control == {
        "test_stand_in.py::test_helper_without_trainer": "passed",
        "test_stand_in.py::test_parameters_are_plain_tensors": "passed",
        "test_stand_in.py::test_class_name_is_kept": "passed",
        "test_stand_in.py::test_fails_on_both_sides": "failed",
    }
    assert ours == {**control, "test_stand_in.py::test_parameters_are_plain_tensors": "failed"}
    comparison = results["comparison"]
    assert comparison["control_passed"] == 3 and comparison["ours_passed_of_those"] == 2
    # Parameters are DTensor shards under FSDP2Trainer: the one miss, which has no reason in KNOWN_DIFFERENCES.
    [miss] = comparison["misses"]
    assert miss["test"] == "test_stand_in.py::test_parameters_are_plain_tensors" and miss["reason"] == "UNEXPLAINED"
    assert miss["ours"] == "failed" and "DTensor" in miss["message"]
    assert comparison["control_passed_building_a_trainer"] == 2  # the helper test builds none
    assert comparison["ours_only_passed"] == []
    assert results["upstream_commits"]["trainer/test_stand_in.py"] == "unknown"
