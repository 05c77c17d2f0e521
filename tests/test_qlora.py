"""QLoRA under FSDP2: a 4-bit NF4 base sharded over 2 ranks, each rank quantizing only its own rows, and LoRA
trained exactly as one process training the same NF4 model (torchao's `to_nf4` on the whole weights, no FSDP)
(tests/workers/qlora_worker.py). Plus the bit-exactness of a rank's NF4 shard and the refusals."""

from __future__ import annotations

import pytest
import torch

from tests.launch import load_runs, run
from tests.test_dropin import differences

pytest.importorskip("torchao", reason="the 'qlora' extra")

# The worker also has "compile" (compile=True on the NF4 base; 2 ranks match one process): not run here, its
# 36 s of inductor compilation on 2 CPU cores would push the suite past its 10-minute aim.
SCENARIOS = ("bnb_config", "switch", "resume", "merged", "sft", "dpo", "checkpointing", "sequence_parallel")


@pytest.fixture(scope="module")
def qlora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """A Llama whose every projection quantizes at 2 ranks (hidden 256), trained plain and with FSDP2Trainer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("qlora")
    config = LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out / "model")
    run("qlora_worker.py", 0, "plain", str(out), str(out / "model"), *SCENARIOS, timeout=600)
    run(
        "qlora_worker.py",
        2,
        "fsdp2",
        str(out),
        str(out / "model"),
        "failed_read",
        "failed_nf4_read",
        *SCENARIOS,
        timeout=600,
    )
    run("qlora_worker.py", 0, "fsdp2", str(out), str(out / "model"), "resume_elsewhere", timeout=600)
    return load_runs(out, "plain-1", "fsdp2-2", "fsdp2-1")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_train_the_nf4_base_as_one_process(qlora, scenario):
    reference, ours = qlora["plain-1"][scenario], qlora["fsdp2-2"][scenario]
    assert "error" not in ours, ours.get("traceback")
    keep = ("losses", "weights", "resumed", "exported")
    found = differences({k: v for k, v in reference.items() if k in keep}, {k: v for k, v in ours.items() if k in keep})
    assert not found, "\n".join(found[:10])


def test_every_projection_is_nf4_and_checkpoints_hold_the_adapter_only(qlora):
    ours = qlora["fsdp2-2"]
    assert len(ours["bnb_config"]["nf4"]) == 14 == len(qlora["plain-1"]["bnb_config"]["nf4"])  # 7 per layer
    assert all("base_layer.weight" in name for name in ours["bnb_config"]["nf4"])
    assert ours["switch"]["nf4"] == ours["bnb_config"]["nf4"]
    files = ours["resume"]["files"]
    assert "adapter_model.safetensors" in files and "optimizer_0" in files and "pytorch_model_fsdp_0" not in files
    assert ours["resume"]["resumed"][2:] == ours["resume"]["losses"][2:]


def test_an_adapter_checkpoint_resumes_at_another_world_size(qlora):
    """checkpoint-2 of the 2-rank run, resumed by one process: the base re-quantized there, the same losses."""
    elsewhere = qlora["fsdp2-1"]["resume_elsewhere"]
    assert "error" not in elsewhere, elsewhere.get("traceback")
    two_ranks = qlora["fsdp2-2"]["resume"]["losses"]
    assert len(elsewhere["resumed"]) == 4  # steps 1-2 from the checkpoint's trainer state, 3-4 trained here
    for a, b in zip(elsewhere["resumed"][2:], two_ranks[2:], strict=True):
        assert abs(a - b) <= 1e-5, (elsewhere["resumed"], two_ranks)


@pytest.mark.parametrize(
    "scenario, named",
    [
        ("failed_read", "rank 1: reading "),
        ("failed_nf4_read", "rank 1: reading model.layers.1.self_attn.k_proj.weight"),
    ],
)
def test_a_read_failing_on_one_rank_fails_every_rank_naming_it(qlora, scenario, named):
    """Each rank reads its slices alone (an NF4 weight's rows too); rank 1's failed read must not leave rank 0
    waiting in the next collective."""
    failed = qlora["fsdp2-2"][scenario]
    assert "loaded" not in failed
    assert named in failed["error"], failed["error"]
    assert "injected: the disk went away" in failed["error"]
    assert "error" not in qlora["fsdp2-2"]["bnb_config"]  # the process group went on to the next scenario


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_skeleton_nf4_weight_has_torchaos_inner_tensors(dtype):
    """NF4 on the meta skeleton is built from shapes alone; each inner tensor as torchao's `to_nf4` makes it."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from hf_fsdp2.adapters.nf4 import meta_nf4

    weight = torch.empty(512, 256, dtype=dtype, device="meta")
    ours, theirs = meta_nf4(weight), to_nf4(weight)
    assert type(ours) is type(theirs) and ours.shape == theirs.shape and ours.stride() == theirs.stride()
    for name in ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data", "nf4"):
        mine, torchao = getattr(ours, name), getattr(theirs, name)
        assert (mine.shape, mine.stride(), mine.dtype, mine.device) == (
            torchao.shape,
            torchao.stride(),
            torchao.dtype,
            torchao.device,
        ), name
    for name in ("block_size", "n_blocks", "scaler_block_size", "dtype", "requires_grad"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize("shape", [(256, 256), (512, 256), (64, 16384), (2048, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shard_quantized_from_its_rows_is_bit_equal_to_chunking_the_whole_quantized_tensor(shape, dtype):
    """Each rank's NF4 from its rows and the whole tensor's mean block absmax equals to_nf4(whole) chunked."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax, to_nf4

    from hf_fsdp2.adapters.nf4 import BLOCK, nf4_from_rows

    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=dtype)
    weight[0, 0] = 30.0  # an outlier block
    whole = to_nf4(weight)
    mean = get_block_absmax(weight.flatten(), BLOCK).mean()
    for rank, rows in enumerate(weight.chunk(2)):
        shard = nf4_from_rows(rows, mean)
        for inner in ("quantized_data", "quantized_scalers", "quantization_factor"):
            mine, theirs = getattr(shard, inner), getattr(whole, inner)
            size = mine.numel()
            assert torch.equal(mine, theirs[rank * size : (rank + 1) * size]), inner
        assert torch.equal(shard.get_original_weight(), whole.get_original_weight().chunk(2)[rank])


def test_which_weights_stay_dense_and_why():
    from torch import nn

    from hf_fsdp2.adapters.nf4 import why_not_nf4

    frozen = nn.Parameter(torch.empty(256, 256, device="meta"), requires_grad=False)
    assert why_not_nf4(frozen, 2) is None
    assert why_not_nf4(frozen, 2, role="the output embeddings (head)") == "the output embeddings (head)"
    assert "do not split over 3 ranks" in why_not_nf4(frozen, 3)
    small = nn.Parameter(torch.empty(128, 128, device="meta"), requires_grad=False)
    assert "not a whole number of 16384-value blocks" in why_not_nf4(small, 2)
    trained = nn.Parameter(torch.empty(256, 256, device="meta"))
    assert why_not_nf4(trained, 2, role="the input embeddings") == "trainable"
    from hf_fsdp2.adapters.nf4 import describe_dense

    dense = {f"model.layers.{i}.mlp.down_proj.weight": "slice" for i in range(3)} | {"lm_head.weight": "head"}
    assert describe_dense(dense) == "lm_head.weight: head; model.layers.*.mlp.down_proj.weight: slice"


def _head_named_output(declared: bool) -> torch.nn.Module:
    """A tiny model (on meta) whose head is `output`, declared by get_output_embeddings or only the last module, and
    whose ordinary projections are called `embed_proj` and `norm_proj`; every weight splits into NF4 at 2 ranks."""
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    class OutputHead(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.embed = nn.Embedding(128, 256)
            self.embed_proj = nn.Linear(256, 256, bias=False)
            self.norm_proj = nn.Linear(256, 256, bias=False)
            self.output = nn.Linear(256, 128, bias=False)

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

    if declared:
        OutputHead.get_output_embeddings = lambda self: self.output
    with torch.device("meta"):
        return OutputHead(PretrainedConfig()).requires_grad_(False)


@pytest.mark.parametrize("declared", [True, False])
def test_the_head_stays_dense_by_its_role_whatever_its_name(declared):
    """A head called `output` (GIT's, InternLM2's) stays dense, declared as the output embeddings or, undeclared, as the
    last module (transformers keeps both out of bitsandbytes' 4-bit too); projections called `embed_proj`/`norm_proj`
    are ordinary weights and become NF4. The substring rule (lm_head, embed, norm) got all three wrong."""
    from peft import LoraConfig, get_peft_model

    from hf_fsdp2.adapters.nf4 import nf4_candidates

    model = _head_named_output(declared)
    chosen, dense = nf4_candidates(model, 2)
    head = "the output embeddings (head)" if declared else "the last module (a task head)"
    assert chosen == ["embed_proj.weight", "norm_proj.weight"] and dense == {"output.weight": head}
    lora = get_peft_model(_head_named_output(declared), LoraConfig(target_modules=["output", "norm_proj"]))
    chosen, dense = nf4_candidates(lora, 2)  # the head's base layer keeps the role of the LoRA layer around it
    assert dense == {"base_model.model.output.base_layer.weight": head}
    assert chosen == ["base_model.model.embed_proj.weight", "base_model.model.norm_proj.base_layer.weight"]


def test_a_git_base_from_its_path_keeps_its_output_head_dense(tmp_path):
    """GIT names its LM head `output` (its blocks have `output.dense` projections): from a path, through the QLoRA
    switch, the head stays dense and every block projection becomes NF4."""
    from peft import LoraConfig, get_peft_model
    from transformers import GitConfig, GitForCausalLM

    from hf_fsdp2 import from_pretrained
    from hf_fsdp2.adapters.nf4 import is_nf4
    from hf_fsdp2.model import quantize_base

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=16)  # fmt: skip
    text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    config = GitConfig(vision_config=vision, **text)
    GitForCausalLM(config).save_pretrained(tmp_path)
    model = get_peft_model(from_pretrained(str(tmp_path)), LoraConfig(target_modules=["query", "value"]))
    quantize_base(model, 2)
    nf4 = sorted(name.removeprefix("base_model.model.git.encoder.layer.0.") for name, p in model.named_parameters()
                 if is_nf4(p))  # fmt: skip
    assert not is_nf4(model.get_parameter("base_model.model.output.weight"))
    assert nf4 == [
        "attention.output.dense.weight", "attention.self.key.weight", "attention.self.query.base_layer.weight",
        "attention.self.value.base_layer.weight", "intermediate.dense.weight", "output.dense.weight",
    ]  # fmt: skip


def test_a_weight_tied_to_another_stays_dense():
    """Tied weights are found by the tie itself (one Parameter under two names), whatever the modules are called."""
    from hf_fsdp2.adapters.nf4 import nf4_candidates

    model = _head_named_output(declared=True)
    model.norm_proj.weight = model.embed_proj.weight
    assert nf4_candidates(model, 2) == ([], {
        "embed_proj.weight": "tied to norm_proj.weight", "norm_proj.weight": "tied to embed_proj.weight",
        "output.weight": "the output embeddings (head)",
    })  # fmt: skip


def test_nf4_is_torchaos_type_not_a_class_name():
    """A subclass of torchao's NF4Tensor is NF4 whatever its name; another library's tensor called NF4Tensor is not."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    from hf_fsdp2.adapters.nf4 import is_nf4, meta_nf4

    nf4 = meta_nf4(torch.empty(256, 64, device="meta"))
    assert is_nf4(nf4)
    inner = ("block_size", "n_blocks", "scaler_block_size", "quantized_scalers", "quantization_factor", "scaler_mean",
             "quantized_data", "nf4")  # fmt: skip
    args = SubclassTensorArgs(nf4.size(), nf4.stride(), 0, nf4.dtype, nf4.device, False)
    renamed = type("QuantizedBase", (NF4Tensor,), {})(args, *(getattr(nf4, name) for name in inner))
    assert is_nf4(renamed)
    other = torch.zeros(4).as_subclass(type("NF4Tensor", (torch.Tensor,), {}))
    assert not is_nf4(other)


def test_other_quantization_configs_are_refused_by_name():
    from transformers import BitsAndBytesConfig

    from hf_fsdp2.loading.skeleton import four_bit_quantization

    kwargs = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")}
    assert four_bit_quantization(kwargs) == "nf4" and "quantization_config" not in kwargs
    for config, named in (
        (BitsAndBytesConfig(load_in_8bit=True), "8-bit"),
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "4-bit fp4"),
    ):
        with pytest.raises(ValueError, match=f"asks for {named} quantization"):
            four_bit_quantization({"quantization_config": config})
    compute = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_compute_dtype=torch.bfloat16)}  # fmt: skip
    four_bit_quantization(compute)
    assert compute["dtype"] == "bfloat16"  # the base is read, and dequantized, in the compute dtype chosen
    # bitsandbytes' default compute dtype (float32) leaves the checkpoint's dtype: a bf16 base is not doubled
    assert "dtype" not in kwargs


def test_a_model_bitsandbytes_quantized_is_refused_naming_the_path_route(tiny):
    from transformers import AutoModelForCausalLM

    from hf_fsdp2 import FSDP2Config, prepare_model

    model = AutoModelForCausalLM.from_pretrained(tiny("llama"))
    model.is_loaded_in_4bit = True  # what from_pretrained(..., quantization_config=BitsAndBytesConfig(...)) sets
    with pytest.raises(ValueError, match="was quantized by bitsandbytes .* Pass the path instead"):
        prepare_model(model, FSDP2Config())


def test_bitsandbytes_quantization_is_found_by_its_types_and_config_not_class_names(tiny):
    """bitsandbytes' 4-bit embedding (EmbeddingNF4: no name on the old list) is refused by its Params4bit weight, a
    model transformers quantized by its BitsAndBytesConfig; a user's own layer called Linear8bitLt is not refused."""
    bnb = pytest.importorskip("bitsandbytes")
    from torch import nn
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp2 import FSDP2Config, prepare_model
    from hf_fsdp2.model import quantized_by_bitsandbytes

    model = AutoModelForCausalLM.from_pretrained(tiny("llama"))
    assert quantized_by_bitsandbytes(model) is None
    model.model.layers[0].mlp.down_proj = type("Linear8bitLt", (nn.Linear,), {})(64, 32)  # not bitsandbytes'
    assert quantized_by_bitsandbytes(model) is None
    model.model.embed_tokens = bnb.nn.EmbeddingNF4(96, 32)
    assert quantized_by_bitsandbytes(model) == "model.embed_tokens: EmbeddingNF4"
    with pytest.raises(ValueError, match=r"quantized by bitsandbytes \(model.embed_tokens: EmbeddingNF4\)"):
        prepare_model(model, FSDP2Config())
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"))
    model.hf_quantizer = type("Quantizer", (), {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})()
    assert quantized_by_bitsandbytes(model) == "quantization_config BitsAndBytesConfig"


def test_a_base_left_trainable_or_too_small_for_nf4_is_refused_naming_why(tiny):
    from peft import LoraConfig, get_peft_model

    from hf_fsdp2 import from_pretrained
    from hf_fsdp2.model import quantize_base

    with pytest.raises(ValueError, match=r"\(no frozen linear weight\); freeze the base"):
        quantize_base(from_pretrained(tiny("llama")), 2)  # full fine-tuning: nothing frozen to quantize
    lora = get_peft_model(from_pretrained(tiny("llama")), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="not a whole number of 16384-value blocks"):  # hidden 64: too small
        quantize_base(lora, 2)
