"""Plant one break at a time in the package and check that the tests named for that feature fail.

A test that stays green when its feature is removed proves nothing. Each entry of scripts/mutations.json names a
feature, one exact snippet of a file under hf_fsdp2/, the broken snippet that replaces it (a dropped call, a
flipped condition, a skipped collective), and the tests that must then fail. For each entry, in turn, this script
copies the checkout's tracked files into a scratch folder, plants the break there (the checkout itself is never
touched), runs those tests with pytest and records whether they caught it.

    python scripts/mutation_sweep.py                      # every entry; about 40 minutes on 2 CPU cores
    python scripts/mutation_sweep.py --only checkpoint    # the entries whose feature or file names this
    python scripts/mutation_sweep.py --json scripts/results/mutation_sweep.json

Exit status 1 when a break survives (its tests passed) or a planted file no longer holds its snippet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTATIONS = os.path.join(ROOT, "scripts", "mutations.json")


def load_mutations(path: str = MUTATIONS) -> list[dict[str, Any]]:
    """The planted breaks, in the order they are run."""
    with open(path) as f:
        return json.load(f)


def planted(source: str, mutation: dict[str, Any]) -> str:
    """`source` with the mutation's snippet replaced; refuses a snippet that is missing or ambiguous."""
    count = source.count(mutation["find"])
    if count != 1:
        raise ValueError(f"{mutation['file']}: the snippet of {mutation['feature']!r} occurs {count} times, not once")
    return source.replace(mutation["find"], mutation["replace"])


def copy_checkout(target: str) -> None:
    """The checkout's tracked and untracked-but-not-ignored files, as CI's clone would see them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(target, name))


def run_one(mutation: dict[str, Any], scratch: str, timeout: int) -> dict[str, Any]:
    """Plant `mutation` in the scratch copy, run its tests, put the file back; what happened."""
    path = os.path.join(scratch, mutation["file"])
    with open(path) as f:
        original = f.read()
    with open(path, "w") as f:
        f.write(planted(original, mutation))
    env = {**os.environ, "PYTHONPATH": scratch, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *mutation["tests"]]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        outcome = {1: "caught", 0: "survived"}.get(proc.returncode, f"pytest exit {proc.returncode}")
        # ERROR: the break made a fixture fail (a crash while loading is a catch too; its line says which).
        failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        summary = (proc.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        outcome, failed, summary = "timed out", [], f"over {timeout} s"
    finally:
        with open(path, "w") as f:
            f.write(original)
    seconds = round(time.perf_counter() - started, 1)
    return {"feature": mutation["feature"], "file": mutation["file"], "outcome": outcome, "failed": failed,
            "summary": summary, "seconds": seconds}  # fmt: skip


def render_table(results: list[dict[str, Any]]) -> str:
    """One row per planted break: the feature, where, what caught it."""
    lines = ["| feature broken | file | outcome | caught by | s |", "|---|---|---|---|---|"]
    for r in results:
        caught_by = ", ".join(line.split("::")[-1].split(" ")[0] for line in r["failed"][:2]) or "—"
        lines.append(f"| {r['feature']} | `{r['file']}` | {r['outcome']} | {caught_by} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    """Run the chosen breaks one after another in one scratch copy; print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the entries whose feature or file contains this text")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one entry's tests (default 900)")
    args = parser.parse_args()
    chosen = [m for m in load_mutations() if args.only in m["feature"] or args.only in m["file"]]
    results = []
    with tempfile.TemporaryDirectory(prefix="mutation_sweep_") as scratch:
        copy_checkout(scratch)
        for number, mutation in enumerate(chosen, 1):
            print(f"[{number}/{len(chosen)}] {mutation['feature']}", file=sys.stderr, flush=True)
            try:
                results.append(run_one(mutation, scratch, args.timeout))
            except ValueError as error:  # the snippet moved: the entry needs updating, which is a failure too
                results.append({"feature": mutation["feature"], "file": mutation["file"], "outcome": str(error),
                                "failed": [], "summary": "", "seconds": 0.0})  # fmt: skip
            print(f"    {results[-1]['outcome']}: {results[-1]['summary']}", file=sys.stderr, flush=True)
    print(render_table(results))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        with open(args.json, "w") as f:
            json.dump({"commit": commit.stdout.strip(), "date": time.strftime("%Y-%m-%d"), "results": results}, f,
                      indent=1)  # fmt: skip
            f.write("\n")
    return 0 if all(r["outcome"] == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
