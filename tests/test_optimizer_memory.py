"""The planner's optimizer state, per family, against what each optimizer really allocates on a small model."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from torch import nn

from hf_fsdp2.optim.muon_routing import Muon, split_for_muon
from hf_fsdp2.optim.state_sizes import PLANNED, state_bytes
from tests.docs_blocks import marked_block
from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "measure"))
from measure_optimizer_state import render_markdown, state_bytes_of  # noqa: E402

SHAPES = [(512, 256), (256, 512), (256,), (1000, 256)]  # two hidden matrices, a norm, an embedding


class Model(nn.Module):
    """One repeated block (a ModuleList member: hf_fsdp2.Muon's matrices) beside an embedding and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        block = nn.Module()
        block.up, block.down = nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False)
        self.blocks = nn.ModuleList([block])
        self.norm = nn.LayerNorm(256, bias=False)


def measured(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Bytes of every state tensor after one step (DTensor or quantised subclasses: their storage)."""
    if hasattr(optimizer, "train"):  # schedule-free optimizers step only in train mode (Trainer sets it)
        optimizer.train()
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    # torchao's low-bit step is torch.compiled; eager allocates the same state (before the compiled update) without
    # the ~10 s per optimizer of kernel builds an empty kernel cache paid here.
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    return state_bytes_of(optimizer)


def _optimizers() -> dict[str, object]:
    """optim name -> a function model -> optimizer, as Trainer builds each (those whose package is installed)."""
    from transformers.optimization import Adafactor

    found = {
        "adamw_torch": lambda m: torch.optim.AdamW(m.parameters()),
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        "rmsprop": lambda m: torch.optim.RMSprop(m.parameters()),
        "adafactor": lambda m: Adafactor(m.parameters(), lr=1e-3, scale_parameter=False, relative_step=False),
        "muon": lambda m: Muon()(m, lr=0.02),
    }
    if importlib.util.find_spec("bitsandbytes"):
        import bitsandbytes as bnb

        found["lion_32bit"] = lambda m: bnb.optim.Lion(m.parameters(), optim_bits=32)
    if importlib.util.find_spec("schedulefree"):
        import schedulefree

        found["schedule_free_adamw"] = lambda m: schedulefree.AdamWScheduleFree(m.parameters())
    if importlib.util.find_spec("torchao"):
        from torchao.optim import AdamW4bit, AdamW8bit

        found["adamw_torch_8bit"] = lambda m: AdamW8bit(m.parameters())
        found["adamw_torch_4bit"] = lambda m: AdamW4bit(m.parameters())
    return found


@pytest.mark.parametrize("optim", sorted(_optimizers()))
def test_planned_state_matches_what_the_optimizer_allocates(optim):
    torch.manual_seed(0)
    model = Model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    muon = [tuple(p.shape) for p in split_for_muon(model)[0]]
    assert len(muon) == 2 or optim != "muon"
    planned = state_bytes(optim, shapes, 4, 1, muon)
    real = measured(_optimizers()[optim](model), model)
    assert planned == pytest.approx(real, rel=0.02), (optim, planned, real)


def test_each_family_is_sized_by_its_own_layout():
    """Per rank at 4 ranks, in units of AdamW's state, on the shapes above."""
    adamw = state_bytes("adamw_torch", SHAPES, 4, 4)
    ratio = {optim: state_bytes(optim, SHAPES, 4, 4, muon=SHAPES[:2]) / adamw for optim in PLANNED}
    assert ratio["lion_32bit"] == 0.5 and ratio["sgd"] == 0.0 and ratio["schedule_free_adamw"] == 1.0
    assert ratio["ademamix"] == 1.5
    assert 0.25 < ratio["adamw_torch_8bit"] < 0.27  # 1 byte per element and state + a fp32 scale per 256
    assert 0.13 < ratio["adamw_torch_4bit"] < 0.14  # half a byte + a fp32 scale per 128
    assert ratio["adafactor"] < 0.02  # a row and a column statistic per matrix (columns on every rank)
    muon_elements = 2 * 512 * 256
    others = 256 + 1000 * 256
    assert ratio["muon"] == pytest.approx((muon_elements + 2 * others) / (2 * (muon_elements + others)))


def test_torchao_quantises_a_shard_only_when_the_shard_is_large_enough():
    """torchao decides on each rank's local tensor: a 64x128 matrix is quantised at 2 ranks (4096 elements each),
    not at 4 (2048)."""
    two, four = state_bytes("adamw_torch_4bit", [(64, 128)], 4, 2), state_bytes("adamw_torch_4bit", [(64, 128)], 4, 4)
    assert two == 2 * (0.5 * 4096 + 4 * 4096 / 128 + 4 * 16)  # codes, a scale per block, the 16-entry code table
    assert four == 2 * 4 * 2048


def test_an_optimizer_the_planner_cannot_size_is_named():
    with pytest.raises(ValueError, match=r"--optim 'adamw_bnb_8bit': the planner knows \["):
        state_bytes("adamw_bnb_8bit", SHAPES, 4, 1)


def test_the_plan_command_sizes_the_optimizer_it_is_given(tiny, capsys):
    from hf_fsdp2.cli import main

    state = {}
    for optim in ("adamw_torch", "adafactor", "muon", "adamw_torch_4bit"):
        assert main(["plan", tiny("llama"), "--nproc", "2", "--seq", "32", "--optim", optim, "--json"]) == 0
        phases = json.loads(capsys.readouterr().out)["phases"]
        state[optim] = next(p["parts"]["optimizer state"] for p in phases if "optimizer state" in p["parts"])
    assert state["adafactor"] < state["muon"] < state["adamw_torch"]
    # Every tensor of the tiny Llama is below torchao's 4096-element threshold: its states stay fp32.
    assert state["adamw_torch_4bit"] == state["adamw_torch"]


def test_docs_optimizer_state_table_is_the_committed_measurement():
    """docs/full-finetuning.md's optimizer-state table is rendered from scripts/results/optimizer_state.json: re-render
    with `python scripts/measure/measure_optimizer_state.py --from-json scripts/results/optimizer_state.json`."""
    with open(os.path.join(ROOT, "scripts", "results", "optimizer_state.json")) as f:
        rows = json.load(f)["rows"]
    assert marked_block("full-finetuning.md", "optimizer-state").strip() == render_markdown(rows).strip()
    muon = next(r for r in rows if r["optim"] == "muon")
    assert muon["step_bytes"] > 0 and 0.6 < muon["vs_adamw"] < 0.8  # momentum for its matrices, AdamW for the rest
