"""Part "cuda_tests": the suite's tests that need a CUDA device and that no other part measures, run by pytest on
the lent GPU: today tests/test_muon.py's bit-equality of Newton–Schulz and of a whole Muon step with torch's on
cuBLAS. Each test's outcome is recorded; on the CPU rehearsal they are skipped ("needs a CUDA device")."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The tests marked `gpu` that only this part runs on a GPU (tests/test_gpu.py's are the other parts' runs).
CUDA_TESTS = ["tests/test_muon.py"]


def cuda_tests(spec: dict) -> dict:
    """Run the `gpu`-marked tests of CUDA_TESTS in a fresh pytest process; each test's outcome by id."""
    with tempfile.TemporaryDirectory() as folder:
        junit = os.path.join(folder, "junit.xml")
        # setup.cfg's addopts need pytest-xdist and pytest-timeout, which the GPU image need not have.
        command = [sys.executable, "-m", "pytest", "-m", "gpu", *CUDA_TESTS, "-o", "addopts=", "-p", "no:cacheprovider"]
        done = subprocess.run([*command, "-q", f"--junitxml={junit}"], cwd=ROOT, capture_output=True, text=True)
        outcomes = _outcomes(junit) if os.path.exists(junit) else {}
    record: dict[str, Any] = {"tests": outcomes}
    failed = [name for name, outcome in outcomes.items() if outcome != "passed" and not outcome.startswith("skipped")]
    if done.returncode not in (0, 5) or failed or not outcomes:  # 5: every test deselected
        record["error"] = f"pytest exit {done.returncode}; failed: {failed}; " + (done.stdout + done.stderr)[-1500:]
    return record


def _outcomes(junit: str) -> dict[str, str]:
    """Each test case's outcome from pytest's JUnit XML: passed, failed: ..., skipped: reason."""
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        child = next(iter(case), None)
        if child is None or child.tag in ("system-out", "system-err", "properties"):
            outcomes[name] = "passed"
        elif child.tag == "skipped":
            outcomes[name] = f"skipped: {child.get('message', '')}"
        else:
            outcomes[name] = f"{child.tag}: {child.get('message', '')[:300]}"
    return outcomes


def cuda_tests_table(part: dict) -> list[str]:
    run = part.get("runs", {}).get("cuda tests", {})
    if not run or "tests" not in run:
        return []
    lines = ["", "| CUDA test (pytest -m gpu) | outcome |", "|---|---|"]
    return lines + [f"| {name} | {outcome[:120]} |" for name, outcome in run["tests"].items()]
