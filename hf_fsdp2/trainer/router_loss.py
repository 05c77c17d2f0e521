"""The router's load-balancing loss of mixture-of-experts models over the global batch, as one process has it.

MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) add `router_aux_loss_coef * aux_loss` to their loss, where
`aux_loss = E * sum_e f_e * P_e` over the batch: f_e the share of top-k assignments to expert e, P_e its mean
router probability. That product of two batch means is not linear in the batch, so N ranks each computing it
on their own rows and averaging gradients train on another loss than one process does — and `Trainer`, which
multiplies the loss by the world size when the model normalizes by `num_items_in_batch`, counts it N times
too (plain DDP `Trainer` as well). Here the assignment counts are summed over all ranks (no gradient flows
through them) and each rank contributes its own rows' router probabilities: the ranks' terms add up to the
global batch's aux loss exactly, value and gradient. Knows nothing about the Trainer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import alone

logger = logging.getLogger(__name__)
# A model's own aux loss and our local recomputation must agree this well, or the model computes it otherwise
# and is left alone.
_AGREEMENT = 1e-5
# Per model class, whether its aux loss is the formula recomputed here: checked at its first step only (the check
# reads two values back to the host, a device sync a step would otherwise pay).
_same_formula_of: dict[str, bool] = {}


def router_config(model: nn.Module) -> tuple[int, int, float] | None:
    """(experts, top_k, coefficient) of a model that adds the Switch-style router loss; None for others."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    coefficient = getattr(config, "router_aux_loss_coef", None)
    if not (experts and top_k and coefficient):
        return None
    return int(experts), int(top_k), float(coefficient)


def _router_sums(
    router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert top-k assignment counts (no grad), router probability sums, and the rows counted."""
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        routing = torch.softmax(logits.to(device), dim=-1).float()
        chosen = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
        hits = torch.ones_like(chosen, dtype=torch.float32) if weight is None else weight.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, hits).detach()
        probs = probs + (routing if weight is None else routing * weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + (routing.shape[0] if weight is None else weight.sum())
    return counts, probs, rows


def global_router_loss(
    router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch's aux loss, and this rank's own aux loss (the model's value).

    NOTE: collective (one all-reduce of experts + 1 numbers); every rank calls it in the same micro-step.
    """
    counts, probs, rows = _router_sums(router_logits, experts, top_k, mask)
    local = experts * torch.sum((counts / rows) * (probs / rows))
    totals = torch.cat([counts, rows.reshape(1)]).detach()
    if not alone():
        dist.all_reduce(totals)
    global_counts, global_rows = totals[:-1], totals[-1]
    share = experts * torch.sum((global_counts / global_rows) * (probs / global_rows))
    return share, local


def _same_formula(model: nn.Module, local: torch.Tensor, aux: torch.Tensor) -> bool:
    """True when the model's own aux loss equals this rank's recomputation (warned once when it does not)."""
    name = type(model).__name__
    if name not in _same_formula_of:
        same = abs(float(local) - float(aux)) <= _AGREEMENT * max(1.0, abs(float(aux)))
        _same_formula_of[name] = same
        if not same:
            logger.warning(
                "%s's router loss (%.6f) is not the Switch-style load-balancing loss recomputed here (%.6f); it is "
                "left per rank, as plain Trainer has it.",
                name,
                float(aux),
                float(local),
            )
    return _same_formula_of[name]


def correct_router_loss(
    loss: torch.Tensor, outputs: Any, model: nn.Module, inputs: dict[str, Any], loss_scale: float
) -> torch.Tensor:
    """Replace the rank-local aux term in `loss` (as Trainer scaled it) by this rank's share of the global one.

    `loss_scale`: the factor Trainer multiplied the model's loss by (the world size, or 1). FSDP averages
    gradients over the ranks, so the share enters multiplied by the world size.
    """
    router = router_config(model)
    aux = outputs.get("aux_loss") if hasattr(outputs, "get") else None
    logits = outputs.get("router_logits") if hasattr(outputs, "get") else None
    if router is None or aux is None or not logits or not isinstance(logits, tuple):
        return loss
    experts, top_k, coefficient = router
    share, local = global_router_loss(logits, experts, top_k, inputs.get("attention_mask"))
    if not _same_formula(model, local, aux):
        return loss
    world = dist.get_world_size() if dist.is_initialized() else 1
    return loss - loss_scale * coefficient * aux.to(loss.device) + world * coefficient * share.to(loss.device)
