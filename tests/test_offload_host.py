"""What cpu_offload runs on the host, testable without an accelerator (issue 63): an Adam/AdamW that is not fused is
named (its for-loop or foreach step is 7-10x slower there than fused: scripts/measure/measure_offload_adamw.py), and
clipping skips its pass over every gradient when nothing is clipped (multiplying by 1.0 changes nothing)."""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2.model import clip_grad_norm
from hf_fsdp2.optim.verdicts import slow_host_step


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))]


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda p: torch.optim.AdamW(p), "for-loop"),  # optim='adamw_torch': torch picks the for-loop on the host
        (lambda p: torch.optim.Adam(p, foreach=True), "foreach"),
        (lambda p: torch.optim.AdamW(p, fused=True), None),  # optim='adamw_torch_fused', Trainer's default
        (lambda p: torch.optim.SGD(p, lr=0.1), None),
    ],
)
def test_a_host_adam_that_is_not_fused_is_named(build, named):
    advice = slow_host_step(build(params()))
    if named is None:
        assert advice is None
    else:
        assert f"torch's {named} implementation" in advice and "optim='adamw_torch_fused'" in advice


def test_clipping_on_the_host_skips_its_pass_when_nothing_is_clipped(monkeypatch):
    calls = []
    multiply = torch.Tensor.mul_
    monkeypatch.setattr(torch.Tensor, "mul_", lambda self, other: calls.append(1) or multiply(self, other))
    weights = params()
    for weight in weights:
        weight.grad = torch.full_like(weight, 0.5)
    norm = clip_grad_norm(weights, max_norm=10.0)  # the norm is sqrt(20) * 0.5 = 2.24: nothing to clip
    assert calls == [] and float(norm) == pytest.approx(20**0.5 * 0.5)
    assert all(torch.equal(w.grad, torch.full_like(w, 0.5)) for w in weights)
    clip_grad_norm(weights, max_norm=1.0)
    assert len(calls) == 2 and float(clip_grad_norm(weights, float("inf"))) == pytest.approx(1.0, rel=1e-5)
