"""The table-driven nearest NF4 level gives torchao's code for every value that matters: every bf16 and fp16 value
in [-1, 1], fp32 values around every decision point and level, NaN (a zero block), and random values."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao", reason="the 'qlora' extra")


def _torchao() -> tuple:
    from hf_fsdp2.adapters.nf4 import BLOCK, SCALER_BLOCK, _torchao_nf4

    nf4 = _torchao_nf4()
    return nf4, BLOCK * SCALER_BLOCK


def _levels(dtype: torch.dtype) -> torch.Tensor:
    nf4, size = _torchao()
    return nf4.NF4Tensor.from_tensor(torch.zeros(size, dtype=dtype), 64, 256).nf4


def _check(values: torch.Tensor) -> None:
    from hf_fsdp2.adapters.nf4_nearest import nearest_codes

    nf4, _ = _torchao()
    levels = _levels(values.dtype)
    theirs = nf4.NF4Tensor.quantize_tensor_nearest(values, levels).to(torch.uint8)
    ours = nearest_codes(values, levels, nf4.NF4Tensor.quantize_tensor_nearest)
    wrong = (ours != theirs).nonzero().flatten()
    assert len(wrong) == 0, [(values[i].item(), ours[i].item(), theirs[i].item()) for i in wrong[:5]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_precision_value_in_range_gets_torchaos_code(dtype):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    in_range = every[(every >= -1) & (every <= 1)]
    _check(torch.cat([in_range, torch.tensor([float("nan"), -0.0, 0.0], dtype=dtype)]))


def test_fp32_values_around_every_decision_point_and_level_get_torchaos_code():
    from hf_fsdp2.adapters.nf4_nearest import decision_points

    nf4, _ = _torchao()
    levels = _levels(torch.float32)
    points = decision_points(levels, nf4.NF4Tensor.quantize_tensor_nearest)
    assert len(points) == 15 and bool((points[1:] > points[:-1]).all())
    centers = torch.cat([points, levels])
    steps = torch.arange(-3000, 3001, dtype=torch.int32)
    around = (centers.view(torch.int32).unsqueeze(-1) + steps).view(torch.float32).flatten()
    torch.manual_seed(0)
    random = torch.rand(1_000_000) * 2 - 1
    _check(torch.cat([around.clamp(-1, 1), random, torch.tensor([float("nan"), -1.0, 1.0, -0.0])]))


def test_values_scaled_from_a_zero_block_are_code_zero_as_in_torchao():
    """A block of zeros divided by its zero absmax is NaN; torchao's first-smallest distance makes it code 0."""
    from hf_fsdp2.adapters.nf4 import nf4_from_rows

    nf4, _ = _torchao()
    weight = torch.randn(256, 256)
    weight[3, :128] = 0.0  # two whole 64-value blocks of zeros
    ours = nf4_from_rows(weight, nf4.get_block_absmax(weight.flatten(), 64).mean())
    assert torch.equal(ours.quantized_data, nf4.to_nf4(weight).quantized_data)
