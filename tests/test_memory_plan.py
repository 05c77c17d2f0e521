"""`hf-fsdp2 plan`: the per-rank arithmetic on fixed sizes, the activation trace, the command line."""

from __future__ import annotations

import json

import pytest
import torch

from hf_fsdp2.cli import main, parse_lora
from hf_fsdp2.planning.activation_trace import LiveBytes, traced_activation_bytes
from hf_fsdp2.planning.memory_plan import plan
from hf_fsdp2.planning.model_sizes import ModelSizes, load_config
from hf_fsdp2.planning.phases import CPU_RUNTIME_BYTES, phases_for
from hf_fsdp2.planning.plan_types import PlanRequest

MIB = 2**20


def sizes(**overrides) -> ModelSizes:
    """A 100 MiB fp32 model: 60 MiB trainable, blocks of 10 MiB, a 20 MiB root, a 16 MiB largest tensor."""
    base = dict(
        params_bytes=100 * MIB, trainable_numel=15 * MIB, trainable_bytes=60 * MIB, buffers_bytes=MIB,
        largest_tensor_bytes=16 * MIB, largest_unit_numel=10 * MIB // 4, largest_unit_trainable_numel=10 * MIB // 4,
        root_numel=20 * MIB // 4, new_bytes=0, block_classes=[],
    )  # fmt: skip
    return ModelSizes(**{**base, **overrides})


def phases(request: PlanRequest, activations: int = 0, **overrides) -> dict[str, dict[str, int]]:
    return {p.name: p.parts for p in phases_for(request, sizes(**overrides), activations)}


def test_one_rank_holds_everything_and_still_gathers_into_unsharded_parameters():
    got = phases(PlanRequest("m", nproc=1, optim="adamw_torch", cpu=False), activations=500 * MIB)
    training = got["training"]
    assert training["sharded parameters"] == 100 * MIB
    assert training["optimizer state"] == 120 * MIB  # AdamW: two fp32 states per trainable element
    assert training["gathered units"] == 60 * MIB and training["activations"] == 500 * MIB
    assert got["load"] == {"sharded parameters": 100 * MIB, "buffers": MIB, "new tensors, full": 0}


def test_lora_adapters_are_drawn_full_on_every_rank_and_cpu_runs_add_the_process_runtime():
    load = phases(PlanRequest("m", nproc=4, cpu=True), new_bytes=3 * MIB)["load"]
    assert load["new tensors, full"] == 6 * MIB  # the replayed values and their copies
    assert load["process runtime (CPU)"] == CPU_RUNTIME_BYTES
    assert "process runtime (CPU)" not in phases(PlanRequest("m", nproc=4, cpu=False))["load"]


def test_cpu_runs_keep_the_root_and_two_blocks_flat_buffers_from_training_on_when_ranks_gather():
    got = phases(PlanRequest("m", nproc=4, cpu=True))
    kept = (20 * MIB // 4 + 2 * 10 * MIB // 4) * 4  # fp32: the root's flat buffer and two blocks'
    for phase in ("training", "checkpoint save (sync)", "export (save_model)"):
        assert got[phase]["reused comm buffers (CPU)"] == kept
    assert "reused comm buffers (CPU)" not in got["load"]
    assert "reused comm buffers (CPU)" not in phases(PlanRequest("m", nproc=4, cpu=False))["training"]
    assert "reused comm buffers (CPU)" not in phases(PlanRequest("m", nproc=1, cpu=True))["training"]


def test_four_ranks_shard_state_and_gather_root_and_two_blocks():
    training = phases(PlanRequest("m", nproc=4, optim="adamw_torch", cpu=False), activations=500 * MIB)["training"]
    assert training["sharded parameters"] == 25 * MIB and training["optimizer state"] == 30 * MIB
    # root (20 MiB) + 2 blocks (20 MiB) gathered, plus one block's unsharded grads and reduce-scatter input
    assert training["gathered units"] == 40 * MIB + 20 * MIB


def test_hsdp_shards_within_a_replica_only():
    load = phases(PlanRequest("m", nproc=4, hsdp=2, cpu=False))["load"]
    assert load["sharded parameters"] == 50 * MIB  # 2 replicas of a model sharded over 2 ranks


def test_without_activations_the_optimizer_step_is_the_peak():
    training = phases(PlanRequest("m", nproc=1, optim="adamw_torch", cpu=False), activations=0)["training"]
    assert training["gradients"] == 60 * MIB and training["optimizer step temporaries"] == 60 * MIB


def test_cpu_offload_leaves_only_buffers_resident_on_the_device():
    training = phases(PlanRequest("m", nproc=2, cpu_offload=True, cpu=False), activations=500 * MIB)["training"]
    assert "sharded parameters" not in training and "optimizer state" not in training


def test_async_staging_copies_this_ranks_shards_to_the_host():
    staging = phases(PlanRequest("m", nproc=2, optim="adamw_torch", cpu=False))["checkpoint save (async staging)"]
    assert staging == {"host copy of shards": 50 * MIB + 60 * MIB}


def test_live_bytes_counts_each_new_storage_once_until_freed():
    weight = torch.zeros(256, 256)
    with LiveBytes([weight]) as tracker:
        a = weight @ weight  # 256 KiB
        b = a.view(-1)  # a view: no new storage
        c = a + 1  # 256 KiB more
        del a, b, c
        d = weight.t()  # a view of a parameter: never counted
    assert tracker.peak == 2 * 256 * 256 * 4 and tracker.live == 0
    assert d.shape == (256, 256)


def test_activation_checkpointing_and_bf16_shrink_traced_activations(tiny):
    config = load_config(tiny("llama"))
    full = traced_activation_bytes(config, torch.float32, batch=2, seq=64)
    checkpointed = traced_activation_bytes(
        config, torch.float32, batch=2, seq=64, checkpoint_blocks=["LlamaDecoderLayer"]
    )
    half = traced_activation_bytes(config, torch.bfloat16, batch=2, seq=64)
    doubled = traced_activation_bytes(config, torch.float32, batch=4, seq=64)
    assert 0 < checkpointed < full and half < full
    assert doubled == pytest.approx(2 * full, rel=0.15)


def test_plan_of_a_config_folder_reads_no_weights(tiny, tmp_path):
    (tmp_path / "config.json").write_text(open(f"{tiny('llama')}/config.json").read())  # no weights at all
    result = plan(str(tmp_path / "config.json"), nproc=2, batch=2, seq=64, device_memory=2**40)
    assert result.fits and {p.name for p in result.phases} >= {"load", "training", "offline consolidation"}
    assert result.to_dict()["training_peak"] == result.training_peak


def test_a_plan_that_does_not_fit_names_changes_that_do(tiny):
    tight = plan(tiny("llama"), nproc=1, batch=8, seq=256, device_memory=1)
    assert not tight.fits and tight.alternatives == []
    roomy = plan(tiny("llama"), nproc=1, batch=8, seq=256).training_peak
    with_ac = plan(tiny("llama"), nproc=1, batch=8, seq=256, activation_checkpointing=True).training_peak
    middle = plan(tiny("llama"), nproc=1, batch=8, seq=256, device_memory=(roomy + with_ac) // 2)
    assert any(a["change"] == "activation_checkpointing=True" for a in middle.alternatives)


@pytest.mark.parametrize(
    ("text", "expected"), [("r=16,targets=q_proj,v_proj", (16, ("q_proj", "v_proj"))), ("r=8", (8, ()))]
)
def test_lora_option_parses(text, expected):
    assert parse_lora(text) == expected


def test_bad_lora_option_is_an_error_naming_the_form():
    with pytest.raises(ValueError, match="r must be a positive integer"):
        parse_lora("targets=q_proj")


def test_cli_prints_json_and_exits_by_verdict(tiny, capsys):
    assert main(["plan", tiny("llama"), "--nproc", "2", "--batch", "2", "--seq", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["request"]["nproc"] == 2
    assert main(["plan", tiny("llama"), "--device-memory", "1KB"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "/nonexistent"]) == 2
    assert "no config.json there" in capsys.readouterr().err


def test_trainer_start_logs_the_plan_and_warns_when_it_will_not_fit(tiny, caplog, monkeypatch):
    import logging

    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.planning import memory_plan as planner
    from hf_fsdp2.planning import phases as arithmetic

    model = AutoModelForCausalLM.from_pretrained(tiny("llama"))
    args = TrainingArguments("unused", per_device_train_batch_size=2, use_cpu=True, report_to=[])
    data = Dataset.from_dict({"input_ids": [[1] * 32] * 4})
    monkeypatch.setattr(transformers.logging.get_logger(), "propagate", True)  # our lines go to transformers' logger
    caplog.set_level(logging.INFO, logger="hf_fsdp2.distributed")
    planner.log_memory_plan(model, args, FSDP2Config(), data)  # a tiny model: the bound says enough
    assert "Memory plan: training needs at most" in caplog.text and "not traced" in caplog.text
    assert "(batch 2 × seq 32" in caplog.text
    # A bound that fits, however narrowly, is not traced: the trace could only lower it, and it holds every rank.
    planned = []
    real_peak = planner.training_peak_of
    monkeypatch.setattr(planner, "training_peak_of", lambda *a, **k: planned.append(real_peak(*a, **k)) or planned[-1])
    planner.log_memory_plan(model, args, FSDP2Config(), data)
    bound, _ = planned[-1]
    monkeypatch.setattr(planner, "detect_device_memory", lambda nproc: bound + bound // 10)
    planner.log_memory_plan(model, args, FSDP2Config(), data)
    assert planned[-1] == (bound, False)
    monkeypatch.setattr(planner, "detect_device_memory", lambda nproc: bound - 1)  # over: traced, to not warn falsely
    planner.log_memory_plan(model, args, FSDP2Config(), data)
    assert planned[-1][1] and planned[-1][0] < bound
    monkeypatch.undo()
    monkeypatch.setattr(transformers.logging.get_logger(), "propagate", True)
    caplog.clear()
    monkeypatch.setattr(arithmetic, "activation_bound", lambda request, config: None)  # a model only a trace describes
    planner.log_memory_plan(model, args, FSDP2Config(), data)
    assert "Memory plan: training needs about" in caplog.text and "(batch 2 × seq 32)" in caplog.text
    monkeypatch.setattr(planner, "detect_device_memory", lambda nproc: 1)
    planner.log_memory_plan(model, args, FSDP2Config(), data)
    assert any(r.levelno == logging.WARNING and "it will not fit" in r.getMessage() for r in caplog.records)
    planner.log_memory_plan(model, args, FSDP2Config(), Dataset.from_dict({"text": ["no token ids"]}))
    assert "No memory plan for this run (KeyError" in caplog.text


def test_a_model_object_is_planned_like_its_folder_and_a_peft_model_by_its_adapter(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_fsdp2 import from_pretrained

    folder = plan(tiny("llama"), nproc=2, batch=2, seq=32, device_memory=2**40)
    for model in (AutoModelForCausalLM.from_pretrained(tiny("llama")), from_pretrained(tiny("llama"))):
        assert plan(model, nproc=2, batch=2, seq=32, device_memory=2**40).phases == folder.phases
    peft = get_peft_model(from_pretrained(tiny("llama")), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    by_path = plan(tiny("llama"), nproc=2, batch=2, seq=32, lora_r=4, lora_targets=("q_proj", "v_proj"))
    assert plan(peft, nproc=2, batch=2, seq=32).phases == by_path.phases
    assert plan(peft, nproc=2, batch=2, seq=32).request.model == "PeftModel (llama)"
    assert json.loads(json.dumps(plan(peft, nproc=2, batch=2, seq=32).to_dict()))["request"]["lora_r"] == 4


def test_cpu_offload_is_neither_advised_nor_planned_without_an_accelerator(tiny):
    """FSDP2Trainer refuses cpu_offload on a CPU machine, so the planner must not propose it there."""
    roomy = plan(tiny("llama"), nproc=1, batch=8, seq=256, cpu=False).training_peak
    offload = plan(tiny("llama"), nproc=1, batch=8, seq=256, cpu=False, cpu_offload=True).training_peak
    between = (roomy + offload) // 2
    on_gpu = plan(tiny("llama"), nproc=1, batch=8, seq=256, cpu=False, device_memory=between)
    assert any(a["change"] == "cpu_offload=True" for a in on_gpu.alternatives)
    on_cpu = plan(tiny("llama"), nproc=1, batch=8, seq=256, cpu=True, device_memory=between)
    assert not any("cpu_offload" in a["change"] for a in on_cpu.alternatives)
    with pytest.raises(ValueError, match="a run without accelerators has nothing to offload"):
        plan(tiny("llama"), cpu=True, cpu_offload=True)


def test_hf_fsdp2_logs_follow_transformers_verbosity():
    """TrainingArguments(log_level=...) sets transformers' verbosity; our INFO lines follow it like Trainer's."""
    import logging

    import transformers

    import hf_fsdp2  # noqa: F401  (links our loggers)

    ours = logging.getLogger("hf_fsdp2.distributed")
    before = transformers.logging.get_verbosity()
    try:
        transformers.logging.set_verbosity_warning()
        assert not ours.isEnabledFor(logging.INFO) and ours.isEnabledFor(logging.WARNING)
        transformers.logging.set_verbosity_info()
        assert ours.isEnabledFor(logging.INFO)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        transformers.logging.get_logger().addHandler(handler)
        try:
            from hf_fsdp2.distributed import log_rank0

            log_rank0("a line for the test")
        finally:
            transformers.logging.get_logger().removeHandler(handler)
        assert [r.getMessage() for r in records] == ["a line for the test"] and records[
            0
        ].name == "hf_fsdp2.distributed"
    finally:
        transformers.logging.set_verbosity(before)


def test_planned_load_and_training_peaks_match_a_real_two_rank_run(tmp_path):
    """End to end: plan a ~30M-parameter Llama at 2 ranks, run it, compare per-rank peaks (goal: ±15%)."""
    import os
    import sys

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    folders = [os.path.join(scripts, "measure"), os.path.join(scripts, "common")]
    sys.path[:0] = folders
    try:
        import validate_plan
        from llama_model import build_model
    finally:
        for folder in folders:
            sys.path.remove(folder)
    path = str(tmp_path / "llama-small")
    build_model(path, 6, hidden=512)
    args = validate_plan.parse_args(["--workdir", str(tmp_path), "--batch", "4", "--seq", "256", "--steps", "2"])
    measured = validate_plan.measure(args, path, nproc=2, lora=False, ac=False)
    predicted = {p.name: p.total / MIB for p in plan(path, nproc=2, batch=4, seq=256, device_memory=2**40).phases}
    for phase, key in (("load", "load_mib"), ("training", "train_mib")):
        worst = max(rank[key] for rank in measured)
        assert 0.85 <= predicted[phase] / worst <= 1.15, (phase, predicted[phase], worst)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_models_are_planned_whole_with_their_experts_traced(tmp_path, capsys, family):
    """Their experts run torch's grouped_mm, whose fake kernel refuses float32 (the trace once failed there);
    gpt-oss's experts are fused gate/up projections with biases."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

    shape = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=True,
    )  # fmt: skip
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**shape, moe_intermediate_size=16, num_experts=8)
    elif family == "mixtral":
        config = MixtralConfig(**shape, num_local_experts=8)
    else:
        config = GptOssConfig(**{**shape, "intermediate_size": 32}, head_dim=8, num_local_experts=8, sliding_window=16)
    config.save_pretrained(tmp_path / family)
    result = plan(str(tmp_path / family), nproc=2, batch=2, seq=32, device_memory=2**40)
    assert result.not_traced is None
    training = next(p for p in result.phases if p.name == "training")
    assert training.parts["activations"] > 0
    assert main(["plan", str(tmp_path / family), "--nproc", "2", "--batch", "2", "--seq", "32"]) == 0
    assert "could not be traced" not in capsys.readouterr().out


def test_a_model_the_trace_cannot_run_is_planned_without_activations_and_says_so(tiny, capsys, monkeypatch):
    """A forward the fake trace cannot run (data-dependent control flow, a kernel without a fake): every other
    figure is still reported, the failure named, and no traceback shown."""
    import hf_fsdp2.planning.activation_trace
    import hf_fsdp2.planning.phases

    def untraceable(*args, **kwargs):
        raise RuntimeError("aten.nonzero: data-dependent output shape")

    monkeypatch.setattr(hf_fsdp2.planning.activation_trace, "traced_activation_bytes", untraceable)
    hf_fsdp2.planning.phases._activations_of.cache_clear()  # traces of this model made by earlier tests
    result = plan(tiny("llama"), nproc=2, batch=2, seq=32, device_memory=2**40)
    assert {p.name for p in result.phases} >= {"load", "training", "export (save_model)"}
    assert result.not_traced and "data-dependent" in result.not_traced
    assert result.training_peak > 0 and not result.alternatives
    status = main(["plan", tiny("llama"), "--nproc", "2", "--batch", "2", "--seq", "32"])
    printed = capsys.readouterr().out
    assert status == 3 and "Activations could not be traced" in printed and "Traceback" not in printed
    hf_fsdp2.planning.phases._activations_of.cache_clear()


def test_qlora_counts_the_nf4_base_in_four_bits(tmp_path):
    """Every projection of this Llama quantizes at 2 ranks: its sharded base shrinks to about 0.52 bytes per element."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    args = dict(nproc=2, lora_r=8, batch=1, seq=32, device_memory=2**40, cpu=True)
    dense = next(p for p in plan(str(tmp_path / "llama"), **args).phases if p.name == "load")
    nf4 = next(p for p in plan(str(tmp_path / "llama"), qlora=True, **args).phases if p.name == "load")
    projections = 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)  # q, o; k, v (2 kv heads); gate, up, down
    saved = dense.parts["sharded parameters"] - nf4.parts["sharded parameters"]
    assert saved == pytest.approx(projections / 2 * (4 - 0.5 - 1 / 64 - 4 / 16384), rel=1e-3)
    assert nf4.parts["one weight's rows before NF4"] == 512 * 256 * 4 // 2
    with pytest.raises(ValueError, match="give lora_r"):
        plan(str(tmp_path / "llama"), nproc=2, qlora=True, device_memory=2**40, cpu=True)


def test_trainer_start_plans_a_qlora_model_with_its_nf4_base(tiny, monkeypatch):
    """A model holding NF4 weights is planned as QLoRA (its base counted in 4 bits), not as a dense LoRA."""
    pytest.importorskip("torchao")
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_fsdp2 import FSDP2Config
    from hf_fsdp2.planning import memory_plan as planner

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny("llama")), LoraConfig(target_modules=["q_proj"]))
    layer = model.get_base_model().model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter(to_nf4(layer.weight.detach(), 64, 32), requires_grad=False)
    seen = []
    monkeypatch.setattr(planner, "training_peak_of", lambda request, *a, **k: seen.append(request) or (0, True))
    args = TrainingArguments("unused", per_device_train_batch_size=2, use_cpu=True, report_to=[])
    planner.log_memory_plan(model, args, FSDP2Config(), Dataset.from_dict({"input_ids": [[1] * 32] * 4}))
    assert seen and seen[0].qlora


def test_a_chunked_loss_is_planned_with_chunk_sized_logits(tmp_path):
    """Long rows, a large vocabulary: the traced step holds the logits of one chunk, not of the whole row."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=1024,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    args = dict(nproc=1, batch=1, seq=1024, device_memory=2**40, cpu=True)
    full = next(p for p in plan(str(tmp_path / "llama"), **args).phases if p.name == "training")
    chunked = next(p for p in plan(str(tmp_path / "llama"), loss_chunk_size=128, **args).phases if p.name == "training")
    logits = 1024 * 8000 * 4  # one row's fp32 logits
    saved = full.parts["activations"] - chunked.parts["activations"]
    assert 1.5 * logits < saved < 3.5 * logits  # the logits, their log-softmax and gradient: now 1/8 of that
    assert main(["plan", str(tmp_path / "llama"), "--seq", "1024", "--loss-chunk-size", "128", "--cpu"]) == 0


def test_sequence_parallelism_plans_one_ranks_slice_with_its_all_to_all_buffers(tmp_path, capsys):
    """N ranks share each row: a rank traces seq / N tokens; the all-to-all buffers cost a little more than that."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    args = dict(nproc=2, batch=1, device_memory=2**40, cpu=True, loss_chunk_size=256)

    def activations(seq: int, sp: int) -> int:
        training = next(
            p
            for p in plan(str(tmp_path / "llama"), seq=seq, sequence_parallel=sp, **args).phases
            if p.name == "training"
        )
        return training.parts["activations"]

    whole, split, half = activations(2048, 1), activations(2048, 2), activations(1024, 1)
    assert half < split < 0.6 * whole  # the slice, plus the exchanged q, k, v and output of one layer at a time
    with pytest.raises(ValueError, match="--sequence-parallel 3 must divide --nproc 2"):
        plan(str(tmp_path / "llama"), seq=2048, sequence_parallel=3, **args)
    assert main(["plan", str(tmp_path / "llama"), "--nproc", "2", "--seq", "2048", "--sequence-parallel", "2"]) == 0
    assert "rows split across 2 ranks" in capsys.readouterr().out


def test_a_generation_phase_holds_the_gathered_model_and_the_kv_cache(tmp_path, capsys):
    """`--generate N`: the whole model in the compute dtype beside the shards, and the KV cache of every token."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    args = dict(nproc=2, batch=4, seq=16, device_memory=2**40, cpu=True)
    assert not any(p.name.startswith("generation") for p in plan(str(tmp_path / "llama"), **args).phases)
    phases = {p.name: p for p in plan(str(tmp_path / "llama"), generate_tokens=8, **args).phases}
    gathering, tokens = phases["generation: gathering (once per call)"], phases["generation: tokens"]
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o; k, v (2 kv heads x 16); MLP; norms
    root = 2 * 512 * 64 + 64  # embeddings and head, final norm
    numel = root + 2 * layer
    assert gathering.parts["gathered model"] == tokens.parts["gathered model"] == numel * 4  # fp32, whole
    # Root first (when it alone is in: whole + flat output + copy-in), or the last block's buffers over the rest.
    in_flight = max(root * 4 * 2.5 - numel * 4, layer * 4 * 1.5)
    assert gathering.parts["all-gather buffers of one unit"] == int(in_flight)
    assert tokens.parts["KV cache"] == 4 * (16 + 8) * 2 * 2 * 2 * 16 * 4  # rows x tokens x layers x k,v x heads x dim
    assert main(["plan", str(tmp_path / "llama"), "--nproc", "2", "--generate", "8", "--cpu"]) == 0
    assert "generation: tokens" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe", "gemma", "qwen3"])
def test_the_start_bound_holds_what_the_trace_counts(family):
    """The trainer's start skips the trace only under this bound, so it must never be below the trace."""
    from hf_fsdp2.planning.model_sizes import skeleton_sizes
    from hf_fsdp2.planning.phases import _activations, activation_bound
    from tests.tiny_models import BUILDERS

    sizes = skeleton_sizes(BUILDERS[family]().config, None, False)
    for batch, seq, checkpointing, chunk in [(1, 16, False, None), (4, 128, False, 64), (2, 128, True, None)]:
        request = PlanRequest("", batch=batch, seq=seq, activation_checkpointing=checkpointing, loss_chunk_size=chunk)
        assert _activations(request, sizes, None) <= activation_bound(request, sizes.config)


def test_compiled_blocks_keep_less_than_eager_ones_and_lora_blocks_compile(tiny):
    """torch.compile's partitioner recomputes the MLP's SiLU and gate product and RMSNorm's fp32 steps in backward
    instead of saving them: at 2 x 256 tokens the tiny Llama's 2 layers save a few MLP-sized tensors fewer."""
    from peft import LoraConfig

    config = load_config(tiny("llama"))
    blocks = ["LlamaDecoderLayer"]
    eager = traced_activation_bytes(config, torch.float32, batch=2, seq=256)
    compiled = traced_activation_bytes(config, torch.float32, batch=2, seq=256, compiled_blocks=blocks)
    mlp_tensor = 2 * 256 * config.intermediate_size * 4
    assert eager - compiled >= config.num_hidden_layers * mlp_tensor  # at least one MLP-sized tensor per layer
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    # LoRA blocks compile too (no GPU measurement of LoRA with compile yet: this checks that they trace).
    assert traced_activation_bytes(config, torch.float32, 2, 256, None, lora, compiled_blocks=blocks) > 0
    # Checkpointed blocks keep their input only, compiled or not: traced as checkpointed.
    checkpointed = traced_activation_bytes(config, torch.float32, 2, 256, blocks)
    assert traced_activation_bytes(config, torch.float32, 2, 256, blocks, compiled_blocks=blocks) == checkpointed
    assert main(["plan", tiny("llama"), "--seq", "256", "--compile", "--cpu"]) == 0


def _gpu_runs() -> tuple[dict, list[dict]]:
    """The committed GPU check: the 1B model's shape and every FSDP2Trainer run the planner part compared."""
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts/results/gpu_h100.json")
    with open(path) as f:
        results = json.load(f)
    runs = results["parts"]["planner"]["runs"]["planner"]["spec"]["measured"]
    return results["environment"], runs


@pytest.mark.parametrize("run", _gpu_runs()[1], ids=lambda run: run["run"])
def test_gpu_peaks_of_the_committed_gpu_check_are_planned_within_ten_percent(tmp_path, run):
    """Each FSDP2Trainer peak the GPU check measured (an H100, 1B Llama; scripts/results/gpu_h100.json), planned
    from this CPU as gpu_check.py's `planner` part plans it: compile=True and the 32k-token chunked loss included."""
    import os
    import sys

    from transformers import LlamaConfig

    environment, _ = _gpu_runs()
    shape = environment["models"][run["model"]]
    LlamaConfig(  # as gpu_check.py's `build` saves it (config.json is all the planner reads)
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        tie_word_embeddings=shape["tied"], rope_theta=500000.0, max_position_embeddings=131072, dtype=shape["dtype"],
    ).save_pretrained(tmp_path)  # fmt: skip
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts/benchmark"))
    try:
        from benchmark_systems import LORA
    finally:
        sys.path.pop(0)
    adapter = run["adapter"]
    planned = plan(
        str(tmp_path), nproc=1, bf16=bool(run["bf16"]), batch=run["batch"], seq=run["seq"],
        activation_checkpointing=bool(run["ac"]), cpu_offload=bool(run["offload"]), lora_r=16 if adapter else None,
        qlora=adapter == "qlora", loss_chunk_size=run["chunk"], compile=bool(run["compile"]), cpu=False,
        device_memory=environment["device_memory_mib"] * MIB,
        **({"lora_targets": tuple(LORA["target_modules"])} if adapter else {}),
    )  # fmt: skip
    assert abs(planned.training_peak / MIB / run["train_peak_mib"] - 1) <= 0.10, (planned.training_peak / MIB, run)
