"""The embedded default: deterministic model, tokenizer and data; the exact-match metric loads offline."""

from __future__ import annotations

import evaluate
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_fsdp2.jobs.demo_task import EXACT_MATCH_PATH, build_demo


def test_demo_is_built_deterministically_and_reloads(tmp_path):
    first, second = build_demo(str(tmp_path / "a")), build_demo(str(tmp_path / "b"))
    for key in ("train", "eval"):
        assert open(first[key]).read() == open(second[key]).read()
    assert open(first["train"]).read() != open(first["eval"]).read()
    tokenizer = AutoTokenizer.from_pretrained(first["model"])
    ids = tokenizer("sort : 3 1 4 1 =")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids[1:]
    assert tokenizer.decode(tokenizer("1 1 3 4", add_special_tokens=False)["input_ids"]) == "1 1 3 4"
    a = AutoModelForCausalLM.from_pretrained(first["model"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(second["model"]).state_dict()
    assert all((a[k] == b[k]).all() for k in a)


def test_exact_match_metric_loads_from_the_package_without_a_hub():
    metric = evaluate.load(EXACT_MATCH_PATH)
    assert metric.compute(predictions=["1 2 ", "3"], references=["1 2", "4"]) == {"exact_match": 0.5}
