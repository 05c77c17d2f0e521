"""Every load route on 2 ranks gives exactly the weights and buffers of single-process `from_pretrained`,
with ties intact; bad input fails on every rank with a message naming the problem (no hang)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.trainer_utils import set_seed

from tests.launch import run, run_batch
from tests.workers.scenarios import ERROR_FILE


def out_dir(root, model: str, flags: tuple[str, ...], nproc: int) -> str:
    return os.path.join(str(root), f"{os.path.basename(model)}-{nproc}-{'-'.join(f.strip('-') for f in flags)}")


def saved_adapter(tiny) -> str:
    """A LoRA adapter saved as peft saves it, its B matrices non-zero (a fresh LoRA's are zeros)."""
    from peft import LoraConfig, get_peft_model

    from tests.workers.load_worker import LORA_KWARGS

    folder = os.path.join(os.path.dirname(tiny("llama")), "llama-adapter")
    if not os.path.exists(os.path.join(folder, "adapter_config.json")):
        torch.manual_seed(3)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny("llama")), LoraConfig(**LORA_KWARGS))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)
        model.save_pretrained(folder)
    return folder


def planned_loads(tiny) -> list[tuple[str, tuple[str, ...], int]]:
    """Every load this module checks (model folder, flags, ranks), refusals included."""
    bin_llama = tiny("llama", safetensors=False)
    loads = [(tiny(m), ("--route", r), 2) for m in ("llama_tied", "gpt2") for r in ROUTES]
    loads += [
        (tiny("llama"), ("--route", "from_pretrained", "--adapter", saved_adapter(tiny)), 2),
        (bin_llama, ("--route", "from_pretrained", "--adapter", saved_adapter(tiny)), 2),
        (bin_llama, ("--route", "from_pretrained"), 2),
        (bin_llama, ("--route", "from_pretrained", "--lora"), 2),
        (tiny("llama"), ("--route", "from_pretrained", "--task", "classify"), 2),
        (tiny("llama"), ("--bf16",), 2),
        (tiny("llama"), ("--hsdp", "2"), 4),
        (tiny("llama"), ("--route", "meta_object"), 2),
        (tiny("llama"), ("--rank1-min-params", "5"), 2),
        (tiny("llama"), ("--hsdp", "3"), 2),
    ]
    if not torch.cuda.is_available():
        loads.append((tiny("llama"), ("--offload",), 2))
    return loads


@pytest.fixture(scope="module")
def loads_root(tmp_path_factory, tiny) -> str:
    """Run every planned load, one launch per world size (each run's refusal lands in its error.txt)."""
    root = tmp_path_factory.mktemp("loads")
    by_world: dict[int, list[list[str]]] = {}
    for model, flags, nproc in planned_loads(tiny):
        by_world.setdefault(nproc, []).append(["--model", model, "--out", out_dir(root, model, flags, nproc), *flags])
    for nproc, runs in by_world.items():
        run_batch("load_worker.py", nproc, runs, str(root / "batches"))
    return str(root)


def load(root, model: str, *flags: str, nproc: int = 2) -> tuple[dict, dict]:
    """What a planned load produced (or, for one not planned, load now)."""
    out = out_dir(root, model, flags, nproc)
    if not os.path.exists(os.path.join(out, "info.json")):
        run("load_worker.py", nproc, "--model", model, "--out", out, *flags)
    with open(os.path.join(out, "info.json")) as f:
        return torch.load(os.path.join(out, "state.pt")), json.load(f)


def reference(model: str, auto=AutoModelForCausalLM, **kwargs) -> dict[str, torch.Tensor]:
    set_seed(42)
    ref = auto.from_pretrained(model, **kwargs)
    state = dict(ref.state_dict())
    state.update({f"buffer:{n}": b for n, b in ref.named_buffers()})
    if ref.get_output_embeddings() is not None and ref.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def assert_exactly(state: dict, ref: dict) -> None:
    state = {k: v for k, v in state.items() if k in ref}
    assert state.keys() == ref.keys(), ref.keys() - state.keys()
    for key, value in ref.items():
        assert torch.equal(state[key], value.to(state[key].dtype)), f"{key} differs"


ROUTES = ["path", "from_pretrained", "object", "object_rank0"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model", ["llama_tied", "gpt2"])
def test_every_route_loads_exactly_what_from_pretrained_loads(loads_root, tiny, route, model):
    state, info = load(loads_root, tiny(model), "--route", route)
    assert_exactly(state, reference(tiny(model)))
    assert info["tied"] and info["sharded"]
    assert info["num_params"] == len(list(AutoModelForCausalLM.from_pretrained(tiny(model)).parameters()))


def test_bin_checkpoints_load_through_rank0_broadcast(loads_root, tiny):
    path = tiny("llama", safetensors=False)
    state, info = load(loads_root, path, "--route", "from_pretrained")
    assert_exactly(state, reference(path))


def test_lora_on_a_bin_skeleton_loads_through_rank0_exactly_as_peft_on_one_process(loads_root, tiny):
    from peft import LoraConfig, get_peft_model

    from tests.workers.load_worker import LORA_KWARGS

    path = tiny("llama", safetensors=False)
    state, info = load(loads_root, path, "--route", "from_pretrained", "--lora")
    set_seed(42)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA_KWARGS)).state_dict()
    assert any("lora_A" in k for k in ref)
    assert_exactly(state, ref)


@pytest.mark.parametrize("safetensors", [True, False], ids=["slices", "rank0"])
def test_a_saved_adapter_loaded_onto_the_skeleton_keeps_its_weights(loads_root, tiny, safetensors):
    """`PeftModel.from_pretrained(hf_fsdp2.from_pretrained(base), adapter_dir)`: torch copies into meta tensors as a
    no-op, so the adapter's trained weights were lost and re-initialized; they must reach the shards as saved."""
    from peft import PeftModel

    path, adapter = tiny("llama", safetensors=safetensors), saved_adapter(tiny)
    state, _ = load(loads_root, path, "--route", "from_pretrained", "--adapter", adapter)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapter, is_trainable=True)
    lora_b = [k for k in ref.state_dict() if "lora_B" in k]
    assert lora_b and all(state[k].abs().sum() > 0 for k in lora_b), "the saved B matrices are non-zero"
    assert_exactly(state, ref.state_dict())


def test_sequence_classification_head_missing_from_checkpoint_matches_from_pretrained(loads_root, tiny):
    state, info = load(loads_root, tiny("llama"), "--route", "from_pretrained", "--task", "classify")
    ref = reference(tiny("llama"), AutoModelForSequenceClassification, num_labels=3)
    assert "score.weight" in ref
    assert_exactly(state, ref)


def test_hsdp_on_four_ranks_loads_exactly(loads_root, tiny):
    state, _ = load(loads_root, tiny("llama"), "--hsdp", "2", nproc=4)
    assert_exactly(state, reference(tiny("llama")))


def test_bf16_keeps_fp32_masters(loads_root, tiny):
    state, info = load(loads_root, tiny("llama"), "--bf16")
    assert info["dtypes"] == ["torch.float32"]
    assert_exactly(state, reference(tiny("llama")))


def _fails(root, model: str, *flags: str, nproc: int = 2) -> str:
    """The error of a planned load that must be refused (or, for one not planned, of a launch now)."""
    error = os.path.join(out_dir(root, model, flags, nproc), ERROR_FILE)
    if os.path.exists(error):
        with open(error) as f:
            return f.read()
    proc = run("load_worker.py", nproc, "--model", model, "--out", str(root), *flags, expect_ok=False, timeout=300)
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def test_checkpoint_of_another_model_names_the_first_mismatching_key(tmp_path, tiny):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copy(os.path.join(tiny("llama"), "config.json"), mixed / "config.json")
    weights = load_file(os.path.join(tiny("llama"), "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(mixed / "model.safetensors"))
    output = _fails(tmp_path / "out", str(mixed))
    assert (
        "model.layers.1.mlp.up_proj.weight: the checkpoint's model.layers.1.mlp.up_proj.weight has shape (3, 3)"
        in output
    )


def test_rank0_without_real_weights_is_refused_on_every_rank(loads_root, tiny):
    output = _fails(loads_root, tiny("llama"), "--route", "meta_object")
    assert "rank 0: rank 0's model has model.embed_tokens.weight on the meta device" in output


def test_ranks_with_different_configs_fail_naming_the_rank(loads_root, tiny):
    output = _fails(loads_root, tiny("llama"), "--rank1-min-params", "5")
    assert "rank 1 has a different FSDP2Config than rank 0" in output


def test_hsdp_size_that_does_not_divide_the_world_is_refused(loads_root, tiny):
    output = _fails(loads_root, tiny("llama"), "--hsdp", "3")
    assert "hsdp_replicate_size=3 does not divide the world size 2" in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU offload is valid with an accelerator")
def test_cpu_offload_without_an_accelerator_is_refused(loads_root, tiny):
    output = _fails(loads_root, tiny("llama"), "--offload")
    assert "cpu_offload=True moves shards from an accelerator to host memory" in output


def test_bf16_bin_checkpoint_broadcast_into_fp32_masters(tmp_path, tiny):
    """The rank-0 route casts while it distributes: bf16 weights arrive exactly in fp32 master shards."""
    from tests.tiny_models import llama

    path = tmp_path / "llama_bf16_bin"
    torch.manual_seed(3)
    model = llama().to(torch.bfloat16)
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    state, info = load(tmp_path / "out", str(path), "--route", "from_pretrained", "--bf16")
    assert info["dtypes"] == ["torch.float32"]
    assert_exactly(state, reference(str(path)))


def test_bf16_safetensors_read_as_slices_into_fp32_masters(tmp_path):
    """Each rank's rows of a bf16 checkpoint (as the hub ships most) are read through the reader's small reused
    buffer and cast: exactly the fp32 values from_pretrained gives, on both ranks' rows."""
    from tests.tiny_models import llama

    path = tmp_path / "llama_bf16"
    torch.manual_seed(4)
    llama().to(torch.bfloat16).save_pretrained(path)
    state, info = load(tmp_path / "out", str(path), "--route", "path", "--bf16")
    assert info["dtypes"] == ["torch.float32"]
    assert_exactly(state, reference(str(path), dtype=torch.float32))


def test_loaded_weights_do_not_change_when_the_checkpoint_is_overwritten_in_place(tmp_path, tiny):
    """The shards hold their own copy of the bytes: a checkpoint rewritten in place after loading (`cp` onto it)
    changes nothing. A private memory map of the file (transformers' native FSDP2 loading) would take the new
    bytes into every weight no step has written yet; here the file's weights become zeros."""
    import shutil

    from safetensors.torch import load_file

    path = tmp_path / "llama"
    shutil.copytree(tiny("llama"), path)
    state, _ = load(tmp_path / "out", str(path), "--route", "path", "--overwrite")
    assert_exactly(state, reference(tiny("llama")))
    assert not any(t.any() for t in load_file(path / "model.safetensors").values())  # the rewrite happened


def test_truncated_safetensors_fails_on_every_rank_naming_the_file(tmp_path, tiny):
    """The last third of the file is gone (a download cut short): every rank stops naming the folder and the
    likely cause, none waits for the others."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(tiny("llama"), cut)
    weights = cut / "model.safetensors"
    os.truncate(weights, weights.stat().st_size * 2 // 3)
    output = _fails(tmp_path / "out", str(cut))
    assert f"reading {cut}: its safetensors files cannot be read" in output and "truncated" in output
