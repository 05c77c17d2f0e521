"""A full disk says so: the first line names the folder, "no space left on device" and the bytes needed against
the bytes free; partial files are removed, older checkpoints untouched, and a relaunch resumes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch import ROOT, load_result
from tests.workers.scenarios import ERROR_FILE

FULL = (
    r"no space left on device: the (checkpoint|export) needs at least ([\d,]+) bytes \([\d.]+ MiB\), "
    r"the file system has ([\d,]+) bytes"
)


def test_a_save_that_plainly_does_not_fit_fails_before_writing_anything(tmp_path):
    import re

    from hf_fsdp2.checkpoints.disk_space import CheckpointDiskFull, check_room

    folder = str(tmp_path / "run" / "checkpoint-2")  # not there yet: its nearest existing parent's file system
    assert check_room(folder, 1000) == 1000  # one process: only its own bytes go there
    with pytest.raises(CheckpointDiskFull) as full:
        check_room(folder, 2**62)
    assert full.value.errno == errno.ENOSPC and isinstance(full.value, OSError)
    assert str(full.value).startswith(f"{folder}: no space left on device: the checkpoint needs at least 4,611,686")
    need, free = (int(n.replace(",", "")) for n in re.search(FULL, str(full.value)).group(2, 3))
    assert need == 2**62 and free < need
    assert not os.path.exists(folder)


def test_a_write_that_fails_for_want_of_space_becomes_the_clear_error_and_the_partial_folder_goes(
    tmp_path, monkeypatch
):
    """DCP's failure (a CheckpointException holding the OSError per rank) and torch.save's short write (a
    RuntimeError with no errno) both become CheckpointDiskFull, with nothing chained above it."""
    import torch.distributed.checkpoint as dcp

    from hf_fsdp2.checkpoints import direct_io
    from hf_fsdp2.checkpoints import sharded_save as checkpoint
    from hf_fsdp2.checkpoints.disk_space import CheckpointDiskFull, CheckpointWriteError, raise_if_write_failed

    def full_disk(fd: int, data: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "pwrite_all", full_disk)
    staging, final = tmp_path / ".checkpoint-4.incomplete", str(tmp_path / "checkpoint-4")
    try:
        dcp.save({"a": torch.randn(100)}, storage_writer=checkpoint.storage_writer(str(staging), True), no_dist=True)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        failure = error
    with pytest.raises(CheckpointDiskFull) as full:
        raise_if_write_failed(failure, final, str(staging), need=400)
    assert str(full.value).startswith(f"{final}: no space left on device: the checkpoint needs at least 400 bytes")
    assert full.value.__cause__ is None and full.value.__context__ is None  # the first error line the user reads
    assert not staging.exists()

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    with pytest.raises(CheckpointDiskFull, match="torch.save|unexpected pos"):
        raise_if_write_failed(short, final, str(staging), need=2**62)  # more than is free: a full disk
    denied = OSError(errno.EACCES, "Permission denied")
    with pytest.raises(CheckpointWriteError, match="could not be written") as other:
        raise_if_write_failed(denied, final, str(staging), need=400)
    assert not isinstance(other.value, CheckpointDiskFull) and other.value.errno == errno.EACCES
    with pytest.raises(KeyError):  # not a failed write: raised as it is
        raise_if_write_failed(KeyError("lm_head.weight"), final, str(staging), need=400)


def _can_mount_tmpfs() -> bool:
    """Whether this machine lets an unprivileged user namespace mount a tmpfs (the real full disk below)."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user namespace to mount a small tmpfs in")
def test_a_really_full_disk_says_so_on_every_rank_keeps_older_checkpoints_and_a_relaunch_resumes(tmp_path, tiny):
    """On tmpfs volumes a fraction of a checkpoint in size (2 ranks): the first save fails before writing and so
    does the export; on a volume that another process fills once the check has passed, the save fails mid-write.
    Each time every rank raises the same CheckpointDiskFull, no checkpoint-N or staging folder is left, the
    checkpoint before is byte for byte as it was, and once the space is free a relaunch resumes to the weights of
    the uninterrupted run."""
    model = tiny("llama")
    small, tiny_volume, roomy, roomy_async = (
        str(tmp_path / name) for name in ("small", "tiny_volume", "roomy", "roomy_async")
    )
    base = ["--model", model, "--save-steps", "2", "--steps", "6"]
    runs = {name: str(tmp_path / name) for name in ("reference", "precheck", "export", "midwrite", "async", "resumed")}
    for folder in runs.values():
        os.makedirs(folder)  # the worker writes its results there; the runs themselves write on the volumes
    spec = {
        "workdir": str(tmp_path),
        "reference": [*base, "--out", runs["reference"]],
        "volumes": {small: 0.5, tiny_volume: 0.1, roomy: 3.5, roomy_async: 3.5},
        "phases": [
            {
                "runs": [
                    [*base, "--out", runs["precheck"], "--run-dir", f"{small}/run"],
                    [*base[:2], "--steps", "1", "--out", runs["export"], "--export-to", f"{tiny_volume}/final"],
                    [*base, "--out", runs["midwrite"], "--run-dir", f"{roomy}/run", "--fill-disk-at-save", "2"],
                    [
                        *base,
                        "--out",
                        runs["async"],
                        "--run-dir",
                        f"{roomy_async}/run",
                        "--fill-disk-at-save",
                        "2",
                        "--async-save",
                    ],
                ]
            },
            {
                "remove": [f"{roomy}/ballast"],
                "runs": [[*base, "--out", runs["resumed"], "--run-dir", f"{roomy}/run", "--resume", "last"]],
            },
        ],
    }
    with open(tmp_path / "spec.json", "w") as f:
        json.dump(spec, f)
    command = [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        sys.executable,
        "-m",
        "tests.workers.disk_full_driver",
    ]
    proc = subprocess.run(
        [*command, str(tmp_path / "spec.json")], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    failed, resumed = (json.load(open(tmp_path / f"phase-{i}.json")) for i in (0, 1))

    for name, folder in (("precheck", f"{small}/run/checkpoint-2"), ("export", f"{tiny_volume}/final")):
        first_line = open(os.path.join(runs[name], ERROR_FILE)).readline()
        assert first_line.startswith(f"CheckpointDiskFull: {folder}: no space left on device"), first_line
        assert "before writing anything" in first_line
        assert failed["stderr"].count(first_line.strip()) == 2  # every rank raised the same line
    for name, volume in (("midwrite", roomy), ("async", roomy_async)):
        line = open(os.path.join(runs[name], ERROR_FILE)).readline()
        assert line.startswith(f"CheckpointDiskFull: {volume}/run/checkpoint-4: no space left on device"), line
        assert "before writing anything" not in line and "No space left on device" in line  # the OSError seen
        assert failed["stderr"].count(line.strip()) == 2
        before = json.load(open(os.path.join(runs[name], "before_fill.json")))
        assert before and {f"{volume}/run/{path}": sha for path, sha in before.items()} == {
            path: sha for path, sha in failed["files"].items() if path.startswith(f"{volume}/run/")
        }  # checkpoint-2 byte for byte, and nothing of checkpoint-4 (nor its staging folder)
    left = {os.path.relpath(path, tmp_path) for path in failed["files"]}
    assert not {path for path in left if path.startswith(("small/", "tiny_volume/"))}  # nothing of refused saves

    assert any("checkpoint-6" in path for path in resumed["files"])
    reference, again = load_result(runs["reference"]), load_result(runs["resumed"])
    assert again["steps_run"] == 4  # from checkpoint-2, the last complete one
    assert again["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    want, got = (torch.load(os.path.join(runs[n], "weights.pt")) for n in ("reference", "resumed"))
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6
