"""scripts/mutation_sweep.py's entries stay plantable: each snippet is still in its file exactly once, the break
parses, and the tests it names exist. The sweep itself (which runs those tests once per break) is a script, not a
test: about 40 minutes on 2 cores; its last results are in scripts/results/mutation_sweep.json."""

from __future__ import annotations

import ast
import json
import os
import sys

import pytest

from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from mutation_sweep import load_mutations, planted  # noqa: E402

MUTATIONS = load_mutations()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m["feature"][:60] for m in MUTATIONS])
def test_each_break_still_plants_into_code_that_parses_and_names_tests_that_exist(mutation):
    with open(os.path.join(ROOT, mutation["file"])) as f:
        ast.parse(planted(f.read(), mutation))
    assert mutation["tests"], "a break no test is named to catch"
    for test in mutation["tests"]:
        path, _, name = test.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            assert not name or f"def {name}(" in f.read(), test


def test_a_snippet_that_moved_or_repeats_is_refused_by_name():
    mutation = {"feature": "demo", "file": "x.py", "find": "a = 1\n", "replace": "a = 2\n"}
    assert planted("a = 1\n", mutation) == "a = 2\n"
    for source, count in (("b = 1\n", 0), ("a = 1\na = 1\n", 2)):
        with pytest.raises(ValueError, match=f"the snippet of 'demo' occurs {count} times, not once"):
            planted(source, mutation)


def test_the_last_sweep_caught_every_break_it_ran():
    """The committed results (a record of the last sweep, not a rerun): every entry that ran was caught."""
    with open(os.path.join(ROOT, "scripts", "results", "mutation_sweep.json")) as f:
        results = json.load(f)["results"]
    assert {r["feature"] for r in results} == {m["feature"] for m in MUTATIONS}
    assert [r for r in results if r["outcome"] != "caught"] == []
