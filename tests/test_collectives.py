"""Every collective the package makes hands its group a tensor on the device that group's backend takes.

The CPU suite runs on gloo, which takes CPU tensors on every group, so a flag left on the CPU (hf_fsdp2 0.1's Muon:
"No backend type associated with device type cpu" on the first step on 2+ GPUs) never failed here. The audit
(`tests/collective_audit.py`) marks tensors that would be on the CPU on GPUs too and fails any that reaches a group
that is NCCL there, or an object collective's payload holding a tensor that would be an accelerator's; the launcher
(`tests/launch.py`) runs every worker of the suite under it, so this class of bug fails the suite on the CPU.

Here: every collective path of the package (`scripts/measure/collective_paths.py`) runs under it at 2 ranks and,
under `communicate_when_alone`, in a world of one (what the GPU check runs on one GPU over NCCL); each must make at
least one collective (a path that took a shortcut would prove nothing). Planted bugs must fail a launch: Muon's old
agreement, a flag without a device planted in `agree`, a device-chosen tensor in `all_gather_object`, a piece of
`.chunk()` of an unplaced tensor, and a tensor moved `.to("cpu")`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hf_fsdp2 import distributed
from tests.collective_audit import AUDIT_FAILED
from tests.launch import run


@pytest.fixture(scope="module", params=[2, 0], ids=["2 ranks", "world of one"])
def report(request, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("collectives"))
    run("collective_paths_worker.py", request.param, out)
    with open(os.path.join(out, f"world{max(request.param, 1)}.json")) as f:
        return json.load(f)


def test_the_audit_catches_a_cpu_flag_on_the_shard_group(report):
    planted = report["planted_cpu_flag"]
    assert planted["outcome"] == "ok" and len(planted["violations"]) == 1
    assert "all_reduce" in planted["violations"][0] and "NCCL on GPUs" in planted["violations"][0]


def test_every_collective_path_runs_on_its_groups_device(report):
    report = {name: r for name, r in report.items() if name != "planted_cpu_flag"}
    assert {name: r["outcome"] for name, r in report.items()} == dict.fromkeys(report, "ok")
    assert {name: r["violations"] for name, r in report.items()} == dict.fromkeys(report, [])
    assert [name for name, r in report.items() if r["calls"] == 0] == []


def test_agree_reduces_on_the_device_its_group_takes(monkeypatch):
    seen = []

    def all_reduce(tensor, op, group, async_op=False):
        seen.append((tensor.device.type, group))
        raise InterruptedError  # a meta tensor has no values to read back

    monkeypatch.setattr(distributed, "alone", lambda group=None: False)
    monkeypatch.setattr(distributed, "is_host_group", lambda group: group == "host")
    monkeypatch.setattr(distributed, "get_device", lambda: torch.device("meta"))
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    for group in ("host", "nccl"):
        with pytest.raises(InterruptedError):
            distributed.agree([1], "max", group)
    assert seen == [("cpu", "host"), ("meta", "nccl")]
    with pytest.raises(ValueError, match="not one of"):
        distributed.agree([1], "mean")


PLANTED = ("planted_agree", "object_payload", "chunked", "moved_to_cpu")
WORKER = "tests/workers/planted_collectives_worker.py"


@pytest.fixture(scope="module")
def planted() -> list[str]:
    """The first line of each violation rank 0 reported, from one 2-rank launch of every case and the allowed ones."""
    proc = run("planted_collectives_worker.py", 2, *PLANTED, "allowed", expect_ok=False)
    # NOTE: AUDIT_FAILED is what fails a test that launches with expect_ok=True: a planted bug fails the suite.
    assert proc.returncode == AUDIT_FAILED, proc.stderr[-4000:]
    report = proc.stderr.split("collective audit: ")[1]  # rank 0's (rank 1's follows its own header)
    return [line for line in report.splitlines()[1:] if " at " in line and not line.startswith(" ")]


def test_a_flag_without_a_device_planted_in_agree_fails_the_launch(planted):
    [violation] = [v for v in planted if "(_planted_agree)" in v]
    # Named where the collective is called: the planted function (the package's agree, replaced), the line to fix.
    assert violation.startswith("all_reduce at tests/workers/planted_collectives_worker.py:")
    assert "NCCL on GPUs" in violation


def test_a_device_chosen_tensor_in_an_object_collective_fails_the_launch(planted):
    [violation] = [v for v in planted if v.startswith("all_gather_object at ")]
    assert "hf_fsdp2/distributed.py" in violation and "(first_on_any_rank)" in violation
    assert "send Python numbers" in violation


@pytest.mark.parametrize("case", ["chunked", "moved_to_cpu"])
def test_a_marked_piece_or_a_tensor_moved_to_the_cpu_fails_the_launch(planted, case):
    [violation] = [v for v in planted if v.startswith(f"all_reduce at {WORKER}:") and f"({case})" in v]
    assert f"written as the CPU, at {WORKER}:" in violation and "NCCL on GPUs" in violation


def test_chosen_devices_cpu_payloads_and_host_groups_pass(planted):
    assert [v for v in planted if "(allowed)" in v] == []
    assert len(planted) == len(PLANTED)
