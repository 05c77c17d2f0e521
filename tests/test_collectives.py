"""Every collective the package makes hands its group a tensor on the device that group's backend takes.

The CPU suite runs on gloo, which takes CPU tensors on every group, so a flag left on the CPU (hf_fsdp2 0.1's Muon:
"No backend type associated with device type cpu" on the first step on 2+ GPUs) never failed here. The audit
(`tests/collective_audit.py`) marks tensors whose device nobody chose and fails any that reaches a group that is
NCCL on GPUs, so this class of bug fails on the CPU. The planted path replays Muon's old agreement and must be
caught; every real path must make at least one collective (a path that took a shortcut would prove nothing), also
at world size 1 under `communicate_when_alone` (what the GPU check runs on one GPU over NCCL).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hf_fsdp2 import distributed
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

    def all_reduce(tensor, op, group):
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
