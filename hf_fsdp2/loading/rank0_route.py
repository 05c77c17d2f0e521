"""The broadcast route: rank 0's weights are the truth (a model object, `.bin` files, files only rank 0 can see,
keys that need transformers' conversion). Rank 0 holds the whole model; every rank's shards are filled from it,
tensor by tensor, and the buffers are sent after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ..adapters.methods import replay_adapters
from ..distributed import is_rank0, raise_if_any_rank
from .facts import facts_of
from .missing_values import rng_state, values_loaded_into_skeleton
from .skeleton import PretrainedSource, first_meta_tensor

Rank0State = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def rank0_state(model: nn.Module, rng: torch.Tensor) -> Rank0State:
    """On rank 0, the full state dict and all buffers that every rank will be given; empty elsewhere."""
    problem: str | None = None
    state: Rank0State = ({}, {})
    if is_rank0():
        try:
            with rng_state(rng):
                state, problem = _full_state_on_rank0(model)
        except Exception as error:  # NOTE: re-raised on every rank below, so no rank waits forever.
            problem = f"{type(error).__name__}: {error}"
    raise_if_any_rank(problem)
    return state


def _full_state_on_rank0(model: nn.Module) -> tuple[Rank0State, str | None]:
    """Read the whole model on rank 0, from its source path or from the object itself."""
    facts = facts_of(model)
    source: PretrainedSource | None = facts.source
    if source is not None:
        real = source.auto_class.from_pretrained(source.path, **source.kwargs)
        if facts.is_peft:
            # The adapters as peft made them on this base; ones the skeleton already holds take precedence.
            given = {n: t for n, t in model.state_dict().items() if not t.is_meta}
            given.update(values_loaded_into_skeleton(model))
            real = replay_adapters(real, model)
            real.load_state_dict(given, strict=False)
        model = real
    else:
        meta = first_meta_tensor(model)
        if meta is not None:
            return ({}, {}), (
                f"rank 0's model has {meta} on the meta device; rank 0 must hold real weights, or build the "
                "model with hf_fsdp2.from_pretrained(path) so each rank reads its own part."
            )
    return (model.state_dict(), dict(model.named_buffers())), None


def load_parameters_from_rank0(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Fill every rank's parameter shards from rank 0's full `weights` (buffers are sent on their own).

    Raises:
        RuntimeError: naming a parameter that rank 0's state did not fill.
    """
    # NOTE: buffers and the further names of tied parameters are left out, and the load is not strict: torch's
    # state dict names a tensor under several names once (VeRA's projections, one BufferDict referenced by every
    # adapted layer; prompt learning's `word_embeddings`, the base's embedding module under a second name), and a
    # strict load wanted the other names too (rank 1: "Missing key(s)"; rank 0 copied a full tensor into a shard).
    # Buffers go out by broadcast_buffers; the ties share the first name's parameter; the rest is checked here.
    aliases = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    aliases |= {name for names in facts_of(model).tie_groups for name in names[1:]}
    weights = {name: tensor for name, tensor in weights.items() if name not in aliases}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    result = set_model_state_dict(model, weights, options=options)
    unloaded = [name for name in result.missing_keys if name not in aliases]
    if unloaded or result.unexpected_keys:
        raise RuntimeError(
            f"rank 0's weights do not fit the model: missing {unloaded[:3]}, unexpected {result.unexpected_keys[:3]}."
        )


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Send every buffer from rank 0 (non-persistent ones are in no state dict)."""
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)
