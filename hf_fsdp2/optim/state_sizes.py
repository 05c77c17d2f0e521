"""How many bytes each optimizer keeps per rank for given parameter shapes: the planner's optimizer state.

Each family is counted by what it really allocates: Adam-like moments per element, Adafactor's row and column
statistics, torchao's 8-/4-bit codes plus one fp32 scale per block (and fp32 for tensors too small to quantise),
Lion's single moment, schedule-free's extra copy, Muon's momentum for its matrices only (AdamW's two moments for
the rest). Shapes come from the planner; this module knows no models and no Trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = tuple[int, ...]

# Per-element states of elementwise optimizers, each the size of the parameter as stored (fp32 masters).
ELEMENTWISE_STATES: dict[str, int] = {
    **dict.fromkeys(["adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_anyprecision", "stable_adamw"], 2),
    **dict.fromkeys(["paged_adamw_32bit", "galore_adamw"], 2),  # GaLore: counted unprojected (an upper bound)
    "grokadamw": 3,  # exp_avg, exp_avg_sq and the gradient's slow EMA
    **dict.fromkeys(["ademamix", "paged_ademamix_32bit"], 3),  # a fast and a slow first moment, one second moment
    **dict.fromkeys(["lion_32bit", "paged_lion_32bit"], 1),
    **dict.fromkeys(["rmsprop", "rmsprop_bnb", "rmsprop_bnb_32bit", "adagrad"], 1),
    **dict.fromkeys(["schedule_free_adamw", "schedule_free_radam"], 2),  # z (the extra weight copy) + exp_avg_sq
    "schedule_free_sgd": 1,  # z
    **dict.fromkeys(["sgd", "lomo"], 0),  # Trainer's SGD has no momentum; LOMO steps inside backward
}
# torchao's low-bit AdamW: bytes per element of each state's codes, its block size, the entries of the fp32 code
# table each quantised state carries, and the smallest shard it
# quantises (smaller ones, or sizes that are not a whole number of blocks, keep fp32 states; torchao decides on each
# rank's local tensor, so more ranks can mean fewer quantised tensors).
LOW_BIT: dict[str, tuple[float, int, int]] = {"adamw_torch_8bit": (1.0, 256, 256), "adamw_torch_4bit": (0.5, 128, 16)}
LOW_BIT_MIN_NUMEL = 4096
FP32 = 4
PLANNED = sorted([*ELEMENTWISE_STATES, *LOW_BIT, "adafactor", "muon"])
# What a step allocates beyond the state, in gradients' worth (foreach lists; fused and hook-based steps: none).
STEP_TEMPORARIES: dict[str, int] = {"adamw_torch_fused": 0, "sgd": 0, "lomo": 0}


def state_bytes(
    optim: str, shapes: Sequence[Shape], element_bytes: float, shard: int, muon: Sequence[Shape] = ()
) -> int:
    """Bytes of optimizer state one rank holds for trainable parameters of `shapes`, split over `shard` ranks.

    `element_bytes`: a trainable element as stored (4 for fp32 masters); `muon`: the shapes `hf_fsdp2.Muon` routes
    to Muon (a subset of `shapes`), for optim="muon".

    Raises:
        ValueError: for an optimizer the planner cannot size, naming those it can.
    """
    if optim in ELEMENTWISE_STATES:
        return int(ELEMENTWISE_STATES[optim] * element_bytes * sum(math.prod(s) for s in shapes) / shard)
    if optim in LOW_BIT:
        return int(sum(_low_bit(optim, _local_numel(s, shard)) for s in shapes))
    if optim == "adafactor":
        return int(sum(_adafactor(s, shard) for s in shapes))
    if optim == "muon":
        adamw = sum(math.prod(s) for s in shapes) - sum(math.prod(s) for s in muon)
        return int((sum(math.prod(s) for s in muon) + 2 * adamw) * element_bytes / shard)
    raise ValueError(f"--optim {optim!r}: the planner knows {PLANNED}.")


def _local_numel(shape: Shape, shard: int) -> int:
    """Elements of rank 0's row block of a tensor split over `shard` ranks (torch.chunk: the largest block)."""
    if not shape:
        return 1
    return -(-shape[0] // shard) * math.prod(shape[1:])


def _low_bit(optim: str, numel: int) -> float:
    """Two states (both moments) of one tensor (a rank's shard) under torchao's low-bit AdamW, which decides per
    shard whether to quantise."""
    code_bytes, block, codes = LOW_BIT[optim]
    if numel < LOW_BIT_MIN_NUMEL or numel % block:
        return 2 * FP32 * numel
    return 2 * (code_bytes * numel + FP32 * numel / block + FP32 * codes)


def _adafactor(shape: Shape, shard: int) -> float:
    """Trainer's Adafactor (no first moment): a matrix keeps a mean per row (split with the rows) and per column
    (whole on every rank); a vector keeps one value per element."""
    if len(shape) < 2:
        return FP32 * math.prod(shape) / shard
    rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
    return FP32 * (rows / shard + cols)
