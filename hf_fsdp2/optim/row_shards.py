"""What the whole-matrix optimizers (Muon, Adafactor) ask of a sharded parameter: its local rows, and the one group
its rows are split over. It knows nothing about either optimizer's maths."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..distributed import alone


def local_part(value: Any) -> Any:
    """This rank's part of a (possibly distributed) tensor, sharing its storage; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def row_shard_group(param: torch.Tensor, who: str, refusal: str) -> tuple[dist.ProcessGroup, int] | None:
    """The group `param`'s rows are split over and that mesh dimension; None when it is whole on this rank.

    Mesh dimensions of one rank split nothing and are passed over (HSDP's replicas, a world of one).

    Raises:
        ValueError: when it is split another way (columns, or over two groups): `who` refuses it, `refusal` says why
            and what to do.
    """
    if not isinstance(param, DTensor):
        return None
    split = [
        (dim, placement)
        for dim, placement in enumerate(param.placements)
        if placement.is_shard() and not alone(param.device_mesh.get_group(dim))
    ]
    if not split:
        return None
    if len(split) > 1 or split[0][1] != Shard(0):
        raise ValueError(f"{who} got a parameter of shape {tuple(param.shape)} placed {param.placements}; {refusal}")
    return param.device_mesh.get_group(split[0][0]), split[0][0]
