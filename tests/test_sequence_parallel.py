"""FSDP2Config(sequence_parallel_size=N): rows split across groups of N ranks, Ulysses attention per document.

Unit tests for the row splitting and the refusals; real runs (gloo, 2 and 4 ranks) of packed training against
plain `transformers.Trainer` in one process on the same global batch, the same ranks without the switch, a
perturbation probe, TRL SFT padding-free, LoRA, and a resume at another sequence-parallel size.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.long_rows.sequence_parallel import check_inputs, check_model, check_padding, split_row
from hf_fsdp2.long_rows.ulysses_attention import _document_mask, documents_of
from tests.launch import load_result, run_batch

TOL = 1e-5
WORKER = "sequence_parallel_worker.py"
# The same global batch of 4 rows per step: 1 process x 4, 2 ranks x 2, 4 ranks x 1.
PER_RANK = {0: "4", 2: "2", 4: "1"}
FAMILIES = ["mistral_window", "qwen2_window", "qwen3", "gemma", "gemma3_text"]


# ---- pure logic ------------------------------------------------------------------------------------------


def test_a_row_is_shifted_whole_then_padded_and_cut_into_contiguous_slices():
    ids = torch.arange(10, 17)[None]  # 7 tokens, 2 documents (positions restart)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    labels = torch.tensor([[-100, 11, 12, -100, 14, 15, 16]])
    parts = [split_row({"input_ids": ids, "labels": labels, "position_ids": positions}, 3, r) for r in range(3)]
    assert [p["input_ids"].shape[1] for p in parts] == [3, 3, 3]  # 7 padded to 9
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "labels", "shift_labels")}
    assert joined["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15, 16, 0, 0]]
    # Shifted over the whole row before the cut: slice 0's last target is slice 1's first token's label.
    assert joined["shift_labels"].tolist() == [[11, 12, -100, 14, 15, 16, -100, -100, -100]]
    assert parts[1]["position_ids"].tolist() == [[0, 1, 2]]  # sliced, never restarted per slice
    assert parts[2]["position_ids"].tolist() == [[3, 4, 5]]  # padding continues the last document
    assert documents_of(parts[0]["whole_positions"]) == [[(0, 3), (3, 9)]]


def test_rows_without_position_ids_get_the_models_own_and_one_document_each():
    part = split_row({"input_ids": torch.ones(2, 4, dtype=torch.long)}, 2, 1)
    assert part["position_ids"].tolist() == [[2, 3], [2, 3]]
    assert documents_of(part["whole_positions"]) == [[(0, 4)], [(0, 4)]]


def test_right_padding_is_accepted_and_left_padding_refused_with_the_fix():
    right = torch.tensor([[1, 1, 1, 0]])
    check_padding(right, torch.tensor([[5, 6, 7, -100]]))
    with pytest.raises(ValueError, match="padding before real tokens.*DataCollatorWithFlattening"):
        check_padding(torch.tensor([[0, 1, 1, 1]]), None)
    with pytest.raises(ValueError, match="labels on padded positions must be -100"):
        check_padding(right, torch.tensor([[5, 6, 7, 8]]))


def test_batches_that_cannot_be_split_are_refused_by_key():
    with pytest.raises(ValueError, match=r"\['pixel_values'\] cannot be split"):
        check_inputs({"input_ids": torch.ones(1, 2), "pixel_values": torch.ones(1, 3)})


def test_document_masks_follow_transformers_sliding_window():
    like = torch.zeros(1)
    assert _document_mask(5, None, "sdpa", like) is None  # sdpa's own is_causal
    assert _document_mask(5, 8, "sdpa", like) is None  # the window covers the document
    windowed = _document_mask(5, 2, "sdpa", like)[0, 0]
    assert windowed.tolist()[4] == [False, False, False, True, True]  # kv > q - window
    eager = _document_mask(3, None, "eager", like)[0, 0]
    assert eager[0, 1] == torch.finfo(like.dtype).min and eager[1, 0] == 0


def test_models_and_settings_it_cannot_run_exactly_are_named():
    import transformers

    small = dict(vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=1)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**small, num_attention_heads=6, num_key_value_heads=2)
        )
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2))
    llama.config._attn_implementation = "sdpa"
    assert check_model(llama, 2, 4) == "sdpa"
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        check_model(llama, 3, 4)
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(6 query heads, 2 key/value"):
        check_model(llama, 4, 4)
    with pytest.raises(ValueError, match="GPT2LMHeadModel \\(model_type='gpt2'\\) is not supported"):
        check_model(gpt2, 2, 2)
    llama.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not supported"):
        check_model(llama, 2, 2)
    with pytest.raises(ValueError, match="sequence_parallel_size=0 must be an int >= 1"):
        FSDP2Config(sequence_parallel_size=0)
    assert FSDP2Config(sequence_parallel_size=2).effective_loss_chunk_size == 4096
    assert FSDP2Config(sequence_parallel_size=2, loss_chunk_size=64).effective_loss_chunk_size == 64


# ---- real runs ---------------------------------------------------------------------------------------------


def _run(model: str, nproc: int, mode: str = "ours", *flags: str) -> list[str]:
    return ["--mode", mode, "--model", model, "--rows-per-rank", PER_RANK[nproc], *flags]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny):
    """Every run of this module, started once per world size; name -> (argv, out)."""
    root = str(tmp_path_factory.mktemp("sequence_parallel"))
    llama = tiny("llama")
    plan = {
        0: {
            "plain": _run(llama, 0, "plain"),
            "plain_padded": _run(llama, 0, "plain", "--collator", "padded"),
            "plain_eager": _run(llama, 0, "plain", "--attn", "eager"),
            "plain_accumulate": ["--mode", "plain", "--model", llama, "--rows-per-rank", "2", "--accumulation", "2"],
            **{f"plain_{f}": _run(tiny(f), 0, "plain") for f in FAMILIES},
        },
        2: {
            "sp2": _run(llama, 2, "ours", "--sp", "2"),
            "sp1": _run(llama, 2, "ours"),
            "sp2_flash_kwargs": _run(llama, 2, "ours", "--sp", "2", "--collator", "flatten_flash_kwargs"),
            "sp2_padded": _run(llama, 2, "ours", "--sp", "2", "--collator", "padded"),
            "sp2_left_padded": _run(llama, 2, "ours", "--sp", "2", "--collator", "left_padded"),
            "sp2_eager": _run(llama, 2, "ours", "--sp", "2", "--attn", "eager"),
            "sp2_checkpointing": _run(llama, 2, "ours", "--sp", "2", "--checkpointing", "--loss-chunk", "7"),
            "sp2_accumulate": [
                "--mode",
                "ours",
                "--model",
                llama,
                "--rows-per-rank",
                "1",
                "--accumulation",
                "2",
                "--sp",
                "2",
            ],
            "sp2_lora": _run(llama, 2, "ours", "--sp", "2", "--lora"),
            "sp1_lora": _run(llama, 2, "ours", "--lora"),
            "sft_sp2": _run(llama, 2, "sft", "--sp", "2"),
            "sft_sp1": _run(llama, 2, "sft"),
            "sft_packing_sp2": _run(llama, 2, "sft", "--sp", "2", "--sft-packing"),
            "sft_packing_sp1": _run(llama, 2, "sft", "--sft-packing"),
            "dpo_sp2": _run(llama, 2, "dpo", "--sp", "2"),
            "probe": ["--mode", "probe", "--model", llama, "--sp", "2"],
            **{f"sp2_{f}": _run(tiny(f), 2, "ours", "--sp", "2") for f in FAMILIES},
            "resumed_full": _run(llama, 2, "ours", "--sp", "2", "--steps", "4", "--save-steps", "2", "--export"),
        },
        4: {
            "sp2x2": _run(llama, 4, "ours", "--sp", "2"),
            "sp4": _run(llama, 4, "ours", "--sp", "4"),  # 2 kv heads for 4 ranks: replicated
            "sp2_hsdp": _run(llama, 4, "ours", "--sp", "2", "--hsdp", "2"),
            "probe4": ["--mode", "probe", "--model", llama, "--sp", "4"],
        },
    }
    outs = {name: os.path.join(root, name) for world in plan.values() for name in world}
    for nproc, named in plan.items():
        run_batch(WORKER, nproc, [[*argv, "--out", outs[name]] for name, argv in named.items()], root)
    # Resume the 2-rank, N=2 run's step-2 checkpoint with N=1 (another sequence-parallel size).
    checkpoint = os.path.join(outs["resumed_full"], "checkpoint-2")
    resumed = _run(llama, 2, "ours", "--steps", "4", "--resume", checkpoint, "--out", os.path.join(root, "resumed"))
    run_batch(WORKER, 2, [resumed], root)
    outs["resumed"] = os.path.join(root, "resumed")
    return outs


def _result(runs, name: str) -> dict:
    error = os.path.join(runs[name], "error.txt")
    assert not os.path.exists(error), open(error).read()
    return load_result(runs[name])


def _same_losses(got: dict, ref: dict, tol: float = TOL) -> None:
    assert len(got["losses"]) == len(ref["losses"]) > 0
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= tol, f"step {step}: {a} vs {b}"


@pytest.mark.parametrize(
    "name, reference",
    [
        ("sp2", "plain"),
        ("sp2x2", "plain"),
        ("sp4", "plain"),
        ("sp2_hsdp", "plain"),
        ("sp2_flash_kwargs", "plain"),
        ("sp2_padded", "plain_padded"),
        ("sp2_eager", "plain_eager"),
        ("sp2_checkpointing", "plain"),
        ("sp2_accumulate", "plain_accumulate"),
        *[(f"sp2_{f}", f"plain_{f}") for f in FAMILIES],
    ],
)
def test_split_rows_train_as_plain_trainer_in_one_process(runs, name, reference):
    got, ref = _result(runs, name), _result(runs, reference)
    _same_losses(got, ref)
    assert abs(got["digest"] - ref["digest"]) <= 1e-4 * ref["digest"]  # the final weights, summed
    assert got["attn_implementation"] == ref["attn_implementation"]  # the user's, not the internal name


def test_the_switch_changes_no_loss_and_no_eval_loss_on_the_same_ranks(runs):
    on, off = _result(runs, "sp2"), _result(runs, "sp1")
    _same_losses(on, off)
    assert abs(on["eval_loss"] - off["eval_loss"]) <= TOL
    _same_losses(_result(runs, "sp2_lora"), _result(runs, "sp1_lora"))
    _same_losses(_result(runs, "sft_sp2"), _result(runs, "sft_sp1"))
    _same_losses(_result(runs, "sft_packing_sp2"), _result(runs, "sft_packing_sp1"))


@pytest.mark.parametrize("name", ["probe", "probe4"])
def test_packed_documents_never_see_each_other(runs, name):
    probe = _result(runs, name)
    assert probe["max_diff_vs_unsplit"] <= 1e-5
    first, others = probe["moved"]
    assert first > 0 and others == 0  # every token of document 1 changed: none of the others moved
    # The probe sees contamination when there is some: one causal attention over the row moves them all.
    assert probe["moved_whole_row_causal"][1] == probe["others"]


def test_left_padding_and_whole_row_losses_are_refused_with_the_fix(runs):
    error = open(os.path.join(runs["sp2_left_padded"], "error.txt")).read()
    assert "padding before real tokens" in error and "DataCollatorWithFlattening" in error
    error = open(os.path.join(runs["dpo_sp2"], "error.txt")).read()
    assert "DPOTrainer computes its own loss from whole rows" in error and "sequence_parallel_size=1" in error


def test_a_checkpoint_resumes_at_another_sequence_parallel_size(runs):
    full, resumed = _result(runs, "resumed_full"), _result(runs, "resumed")
    # The resumed run's history holds steps 1-2 from the checkpoint; steps 3-4 were trained at N=1.
    _same_losses({"losses": resumed["losses"][2:]}, {"losses": full["losses"][2:]})
    config = open(os.path.join(runs["resumed_full"], "config.json")).read()
    assert '"hf_fsdp2' not in config  # the export names no internal attention
    assert full["generate_same"]  # greedy tokens of the trained sharded model = its export loaded unsharded


def test_only_trls_own_sft_trainer_is_trusted_with_slices_not_any_class_of_that_name():
    """TRL's SFTTrainer scores slices; a user's class that is also called SFTTrainer (old rule: by name) is not."""
    trl = pytest.importorskip("trl")
    from transformers import Trainer

    from hf_fsdp2.trainer.step import whole_row_losses

    class SFTTrainer(Trainer):  # a user's, with a loss over whole rows
        def compute_loss(self, *args, **kwargs):
            raise NotImplementedError

    assert whole_row_losses(object.__new__(SFTTrainer)) == [SFTTrainer]
    assert whole_row_losses(object.__new__(trl.SFTTrainer)) == []
