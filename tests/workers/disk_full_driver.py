"""The full-disk scenarios on real small file systems: run as `unshare --user --map-root-user --mount python -m
tests.workers.disk_full_driver SPEC.json`, it mounts tmpfs volumes (gone when it exits) and runs train_worker
batches on them.

SPEC: {"workdir": folder outside the volumes, "reference": argv of a run on the normal disk (run first; its
checkpoint-2 sets the volumes' sizes), "volumes": {folder: size in checkpoints}, "phases": [{"remove": [paths],
"runs": [argv, ...]}]}. After each phase it writes WORKDIR/phase-<i>.json: every file on the volumes with its
sha256, and the launch's stderr (every rank's errors).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from tests.launch import run_batch

PAGE = 4096


def folder_bytes(folder: str) -> int:
    """Bytes the files under `folder` take on a tmpfs (each rounded up to whole pages)."""
    sizes = [os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files]
    return sum(-(-size // PAGE) * PAGE for size in sizes)


def files_on(folders: list[str]) -> dict[str, str]:
    """Every file under `folders`, as path -> sha256."""
    out = {}
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


def main(spec_file: str) -> None:
    with open(spec_file) as f:
        spec = json.load(f)
    workdir = spec["workdir"]
    run_batch("train_worker.py", 2, [spec["reference"]], os.path.join(workdir, "batches"))
    reference_run = os.path.join(spec["reference"][spec["reference"].index("--out") + 1], "run")
    checkpoint = folder_bytes(os.path.join(reference_run, "checkpoint-2"))
    for folder, checkpoints in spec["volumes"].items():
        os.makedirs(folder, exist_ok=True)
        size = int(checkpoints * checkpoint) // PAGE * PAGE
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], check=True)
    for i, phase in enumerate(spec["phases"]):
        for path in phase.get("remove", []):
            os.remove(path)
        proc = run_batch("train_worker.py", 2, phase["runs"], os.path.join(workdir, "batches"))
        state = {"checkpoint_bytes": checkpoint, "files": files_on(list(spec["volumes"])), "stderr": proc.stderr}
        with open(os.path.join(workdir, f"phase-{i}.json"), "w") as f:
            json.dump(state, f)


if __name__ == "__main__":
    main(sys.argv[1])
