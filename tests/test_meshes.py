"""hf_fsdp2's meshes take the CPU tensors CPU offload makes, even when the default group refuses them as NCCL does.

On N GPUs, Accelerate starts an NCCL-only group under torchrun, and offloaded gradients are CPU DTensors: a grad norm
over a mesh of that group fails ("No backend type associated with device type cpu"; pytorch#148532), and only from
two GPUs on. Here two CPU ranks start the default group as gloo for CUDA tensors only, which refuses CPU tensors the
same way; the control (torch's plain mesh) must fail, and every offload path over hf_fsdp2's mesh must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_fsdp2 import distributed, shared_device
from hf_fsdp2.meshes import add_cpu_backend
from tests.launch import ROOT, load_result, run


@pytest.mark.parametrize(
    ("config", "wanted"),
    [
        ("cuda:nccl", "cpu:gloo,cuda:nccl"),  # what Accelerate starts on GPUs
        ("cuda:gloo", "cpu:gloo,cuda:gloo"),  # hf_fsdp2.shared_device on one GPU
        ("xpu:xccl", "cpu:gloo,xpu:xccl"),
        ("cpu:gloo,cuda:nccl", None),  # what hf_fsdp2 starts itself
        ("cpu:gloo,cuda:gloo", None),  # init_process_group("gloo")
        ("undefined", None),
    ],
)
def test_gloo_for_the_cpu_is_added_only_where_missing(config, wanted):
    assert add_cpu_backend(config) == wanted


@pytest.fixture(scope="module")
def nccl_rules(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("nccl_rules"))
    run("nccl_rules_worker.py", 2, out)
    return load_result(out)


def test_torchs_plain_mesh_on_such_a_group_refuses_cpu_tensors(nccl_rules):
    assert nccl_rules["control"]["outcome"] == "RuntimeError: No backend type associated with device type cpu"


def test_every_offload_path_runs_on_hf_fsdp2s_mesh(nccl_rules):
    paths = {name: result["outcome"] for name, result in nccl_rules.items() if name != "control"}
    assert paths == dict.fromkeys(paths, "ok")


def test_the_grad_norm_and_clipping_equal_one_process(nccl_rules):
    clipped = nccl_rules["grad_norm_and_clip"]
    assert clipped["norm"] > 0.01  # so the gradients really were scaled down
    assert clipped["norm_error"] <= 1e-6 * clipped["norm"]
    assert clipped["clipped_error"] <= 1e-7 and clipped["scale_grad_error"] == 0.0
    assert nccl_rules["hsdp_groups"]["norm"] == pytest.approx(clipped["norm"], rel=1e-6)


def test_ranks_on_one_device_share_it_as_accelerate_picks_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.get_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.get_device() == torch.device("cuda", 1)


def test_the_shared_device_launcher_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="runs under torchrun"):
        shared_device.start_shared_group()
    with pytest.raises(SystemExit, match="usage: torchrun"):
        shared_device.main([])


def test_an_unchanged_trainer_script_runs_through_the_shared_device_launcher(tmp_path, tiny):
    # The command the docs give, with real torchrun; on this CPU machine the launcher starts gloo as torchrun would.
    script = os.path.join(ROOT, "tests", "workers", "unchanged_script.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    command += ["hf_fsdp2.shared_device", script, tiny("llama"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("at exit: process group open False") == 2, proc.stdout


def test_on_one_gpu_every_rank_joins_cuda_gloo_on_device_0_as_its_nodes_first(monkeypatch):
    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", started.append)
    monkeypatch.setattr(shared_device.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(shared_device.dist, "init_process_group", lambda backend: started.append(backend))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert shared_device.start_shared_group() == torch.device("cuda", 0)
    # Accelerate's barrier takes LOCAL_RANK as its device: cuda:1 does not exist on one GPU.
    assert started == [torch.device("cuda", 0), "cuda:gloo"] and os.environ["LOCAL_RANK"] == "0"
