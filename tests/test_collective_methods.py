"""`trainer.model.save_pretrained(dir)` and `generate` after training at 2 ranks: on every rank they work like
`trainer.save_model`; on rank 0 only they fail within the bound, naming the fix, instead of hanging."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import run

# What save_model adds beside the model's own files (save_pretrained of a model writes neither).
TRAINER_FILES = {"training_args.bin"}


@pytest.fixture(scope="module")
def every_rank(tmp_path_factory, tiny) -> str:
    out = str(tmp_path_factory.mktemp("collective"))
    run("collective_worker.py", 2, tiny("llama_tied"), out, "every")
    return out


def tensors(folder: str) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        found.update(load_file(os.path.join(folder, name)))
    return found


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_save_pretrained_on_every_rank_writes_the_folder_save_model_writes(every_rank, kind):
    with open(os.path.join(every_rank, "every.json")) as f:
        assert json.load(f) == "ok"
    ours, reference = (os.path.join(every_rank, kind, name) for name in ("pretrained", "save_model"))
    assert set(os.listdir(ours)) == set(os.listdir(reference)) - TRAINER_FILES
    mine, theirs = tensors(ours), tensors(reference)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    if kind == "full":
        assert "lm_head.weight" not in mine, "tied weights are written once"
        with open(os.path.join(ours, "config.json")) as a, open(os.path.join(reference, "config.json")) as b:
            assert json.load(a) == json.load(b)
    else:
        assert set(os.listdir(ours)) == {"adapter_model.safetensors", "adapter_config.json"}


@pytest.mark.parametrize("mode", ["rank0_save", "rank0_generate"])
def test_a_call_on_rank_0_only_fails_within_the_bound_naming_the_fix(tmp_path, tiny, mode):
    run("collective_worker.py", 2, tiny("llama"), str(tmp_path), mode, timeout=300)
    with open(tmp_path / f"{mode}.json") as f:
        result = json.load(f)
    assert result["error"] is not None, "the call on one rank returned instead of failing"
    assert "every rank must call it" in result["error"] and "trainer.save_model(dir)" in result["error"]
    assert result["seconds"] < 5 + 10, result  # the bound (5 s in the worker) and a margin


def test_generate_gathers_per_token_when_the_gathered_model_would_not_fit(monkeypatch, hf_fsdp2_records):
    """The decision is agreed by every rank; when the whole model would not fit it falls back, saying so once."""
    from torch import nn

    from hf_fsdp2.sharding import collective_methods

    model = nn.Linear(2, 2)
    monkeypatch.setattr(collective_methods, "gathered_bytes", lambda m: 10 * 2**30)
    monkeypatch.setattr(collective_methods, "free_memory", lambda: 2 * 2**30)
    assert not collective_methods.gathered_fits(model)
    assert not collective_methods.gathered_fits(model)
    said = [r.getMessage() for r in hf_fsdp2_records if "gathering each unit per token" in r.getMessage()]
    assert len(said) == 1 and "10.0 GiB" in said[0]
    monkeypatch.setattr(collective_methods, "free_memory", lambda: 100 * 2**30)
    assert collective_methods.gathered_fits(model)


def test_generate_runs_only_the_blocks_hf_fsdp2_compiled_eagerly_and_compiles_them_again_after():
    """`eager_blocks` clears the compiled call of the blocks FSDP2Config(compile=True) compiled, for generate's
    duration; a module the user compiled keeps its compiled call (transformers' static-cache compile, their own)."""
    from hf_fsdp2.sharding.collective_methods import eager_blocks
    from hf_fsdp2.sharding.units import COMPILED_BY_US

    ours, theirs = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(ours, theirs)
    ours.compile(), theirs.compile()  # lazily wrapped: nothing compiles until called
    setattr(ours, COMPILED_BY_US, True)
    compiled = ours._compiled_call_impl, theirs._compiled_call_impl
    with eager_blocks(model):
        assert ours._compiled_call_impl is None and theirs._compiled_call_impl is compiled[1]
    assert (ours._compiled_call_impl, theirs._compiled_call_impl) == compiled
    with pytest.raises(RuntimeError), eager_blocks(model):  # put back after an error inside generate too
        raise RuntimeError("generate failed")
    assert ours._compiled_call_impl is compiled[0]
