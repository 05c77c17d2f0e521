"""Reading DCP folders in place (hf_fsdp2.checkpoints.distcp_reader) and resuming a stateless optimizer without fake
steps."""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from hf_fsdp2.checkpoints import distcp_reader
from hf_fsdp2.checkpoints.distcp_reader import SafeFileSystemReader
from hf_fsdp2.checkpoints.sharded import OPTIMIZER_DIR, OPTIMIZER_KEY, load_in_place, read_metadata
from hf_fsdp2.checkpoints.sharded_resume import resume_optimizer


def saved_state(folder: str) -> dict[str, torch.Tensor]:
    """A state of every shape and dtype a checkpoint holds (0-dim Adam steps, bf16, int), saved to `folder`."""
    generator = torch.Generator().manual_seed(0)
    state = {
        "weight": torch.randn(96, 40, generator=generator),
        "bias": torch.randn(40, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "ids": torch.arange(30, dtype=torch.int64).reshape(3, 10),
        "half": torch.randn(5, 3, 2, generator=generator).half(),
    }
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return state


def empty_like_saved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.full_like(value, 3) for key, value in state.items()}


def test_every_tensor_is_read_in_place_bit_for_bit(tmp_path, monkeypatch):
    saved = saved_state(str(tmp_path))
    through_torch: list[int] = []
    original = FileSystemReader.read_data
    monkeypatch.setattr(
        FileSystemReader,
        "read_data",
        lambda self, plan, planner: through_torch.append(len(plan.items)) or original(self, plan, planner),
    )
    loaded = empty_like_saved(saved)
    load_in_place(loaded, str(tmp_path))
    assert through_torch == [0]  # nothing was left to torch.load
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_a_record_that_is_not_plain_goes_through_torch_and_reads_the_same(tmp_path, monkeypatch):
    saved = saved_state(str(tmp_path))
    monkeypatch.setattr(distcp_reader, "storage_bytes_offset", lambda *args: None)
    loaded = empty_like_saved(saved)
    load_in_place(loaded, str(tmp_path))
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_a_record_of_another_size_than_the_metadata_says_is_not_read_in_place(tmp_path):
    saved_state(str(tmp_path))
    metadata = read_metadata(str(tmp_path))
    reader = SafeFileSystemReader(str(tmp_path))
    reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    index, info = next((i, s) for i, s in reader.storage_data.items() if i.fqn == "weight")
    with open(os.path.join(str(tmp_path), info.relative_path), "rb", buffering=0) as file:
        assert distcp_reader.storage_bytes_offset(file, info.offset, info.length, 96 * 40 * 4) is not None
        assert distcp_reader.storage_bytes_offset(file, info.offset, info.length, 96 * 40 * 4 - 4) is None
        assert distcp_reader.storage_bytes_offset(file, info.offset, info.length - 100, 96 * 40 * 4) is None


def test_a_truncated_file_is_an_error_naming_the_folder(tmp_path):
    saved = saved_state(str(tmp_path))
    for path in glob.glob(os.path.join(str(tmp_path), "*.distcp")):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=f"could not read the checkpoint in {tmp_path}"):
        load_in_place(empty_like_saved(saved), str(tmp_path))


def sgd_checkpoint(folder: str, momentum: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an SGD optimizer that took one step, saved as FSDP2Trainer saves its optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.2}],
        momentum=momentum,
    )
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)  # as at a resume: no gradients yet
    dcp.save(
        {OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=os.path.join(folder, OPTIMIZER_DIR),
        no_dist=True,
    )
    return model, optimizer


def counting_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    calls: list[int] = []
    original = optimizer.step
    optimizer.step = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)  # type: ignore[method-assign]
    return calls


def test_a_stateless_optimizer_resumes_its_hyperparameters_without_any_step(tmp_path):
    model, _ = sgd_checkpoint(str(tmp_path), momentum=0.0)
    weights = [p.detach().clone() for p in model.parameters()]
    fresh = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.9)
    steps = counting_steps(fresh)
    resume_optimizer(model, fresh, str(tmp_path))
    assert [g["lr"] for g in fresh.param_groups] == [0.1, 0.2]
    # torch's path ran a zero-gradient step twice, each giving every parameter a gradient first
    assert steps == [] and not fresh.state
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_a_stateful_optimizer_still_resumes_its_state(tmp_path):
    model, saved = sgd_checkpoint(str(tmp_path), momentum=0.9)
    fresh = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.9, momentum=0.9
    )
    resume_optimizer(model, fresh, str(tmp_path))
    assert [g["lr"] for g in fresh.param_groups] == [0.1, 0.2]
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["momentum_buffer"], saved.state[p]["momentum_buffer"])


def test_a_stateless_optimizer_built_for_other_parameters_is_refused(tmp_path):
    model, _ = sgd_checkpoint(str(tmp_path), momentum=0.0)
    fresh = torch.optim.SGD(model.parameters(), lr=0.9)  # one group of 4 where the checkpoint has two of 2
    with pytest.raises(ValueError, match=r"parameter groups of sizes \[2, 2\], this optimizer \[4\]"):
        resume_optimizer(model, fresh, str(tmp_path))


def adam_checkpoint(folder: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW optimizer that took two steps, saved as FSDP2Trainer saves its optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    dcp.save(
        {OPTIMIZER_KEY: get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=os.path.join(folder, OPTIMIZER_DIR),
        no_dist=True,
    )
    return model, optimizer


def test_adam_state_is_read_into_allocated_tensors_without_a_zero_gradient_step(tmp_path):
    model, saved = adam_checkpoint(str(tmp_path))
    weights = [p.detach().clone() for p in model.parameters()]
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    steps = counting_steps(fresh)
    resume_optimizer(model, fresh, str(tmp_path))
    # torch's path gave every parameter a zero gradient and took a step to create the state it then overwrote
    assert steps == [] and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert fresh.param_groups[0]["lr"] == 0.1
    for p in model.parameters():
        assert fresh.state[p].keys() == saved.state[p].keys()
        for name, value in saved.state[p].items():
            assert torch.equal(fresh.state[p][name], value), name


def test_state_it_cannot_allocate_is_left_to_torch_and_still_resumed(tmp_path):
    """A state entry that is not a tensor (here a custom float) takes torch's own path, as before (which, like
    torch's, restores only the state its zero-gradient step creates)."""
    model, saved = adam_checkpoint(str(tmp_path))
    original = saved.state_dict
    saved.state_dict = lambda: _with_float_state(original())  # type: ignore[method-assign]
    dcp.save(
        {OPTIMIZER_KEY: get_optimizer_state_dict(model, saved)},
        checkpoint_id=os.path.join(str(tmp_path), OPTIMIZER_DIR),
        no_dist=True,
    )
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    steps = counting_steps(fresh)
    resume_optimizer(model, fresh, str(tmp_path))
    assert steps == [1]  # torch's zero-gradient step created the state
    for p in model.parameters():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][name], saved.state[p][name]), name


def _with_float_state(state_dict: dict) -> dict:
    for entry in state_dict["state"].values():
        entry["custom"] = 0.25
    return state_dict
