"""A causal LM's head and cross entropy in chunks of tokens, each chunk's logits recomputed in backward, so the
loss never holds sequence x vocabulary logits (64k tokens x 128k vocabulary are 32 GiB in fp32).

The model's own forward still runs: while training, its head hands the hidden states through and its
`loss_function` becomes the chunked one, which applies the head's weight chunk by chunk. The same operations
as transformers' `ForCausalLMLoss` (labels shifted over the whole row, logits upcast to fp32, a sum over the
targets divided by `num_items_in_batch`, else their mean), summed in another order. Models whose forward does
more between the head and the loss (logit soft-capping, scaling) train unchunked, with one log line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..distributed import log_rank0
from ..loading.facts import forward_source

IGNORE_INDEX = -100
# Words in a forward that mean it changes the logits between the head and the loss.
_LOGIT_CHANGES = re.compile(r"softcap|logit_scale|logits_scaling|z_loss|router_z")


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor | None,
    chunk_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ForCausalLMLoss(head(hidden), labels, ...)` without the full logits: chunks of `chunk_size` tokens."""
    if shift_labels is None:
        shift_labels = shifted_labels(labels, ignore_index)
    flat = hidden.reshape(-1, hidden.size(-1))
    targets = shift_labels.reshape(-1).to(flat.device)
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.size(0), chunk_size):
        end = start + chunk_size
        # NOTE: read the weight here, inside the model's forward: under FSDP2 it is the gathered parameter now.
        total = total + checkpoint(
            _chunk_loss, flat[start:end], head.weight, head.bias, targets[start:end], ignore_index, use_reentrant=False
        )
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def shifted_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Each position's target, the next token's label, shifted over the whole row (the last one ignored), as
    transformers' ForCausalLMLoss does before it flattens."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Summed cross entropy of one chunk (its logits live only inside this call and its recomputation)."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def why_not_chunked(model: nn.Module) -> str | None:
    """Why this causal LM's loss cannot be chunked exactly, or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"its output head is {type(head).__name__}, not a plain nn.Linear"
    forward = forward_source(model)
    if forward is None or "self.loss_function(" not in forward:
        return "its forward does not call self.loss_function"
    _, head_call, after_head = forward.partition("self.lm_head(")
    if not head_call or _LOGIT_CHANGES.search(after_head.partition("self.loss_function(")[0]):
        return "its forward changes the logits between the head and the loss"
    return None


@contextlib.contextmanager
def chunked_loss(model: nn.Module, chunk_size: int) -> Iterator[None]:
    """While inside, `model`'s head passes hidden states through and its loss is computed in chunks."""
    head = model.get_output_embeddings()
    had_loss = "_loss_function" in model.__dict__
    previous = model.__dict__.get("_loss_function")

    def loss_function(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int, **kwargs: Any) -> Any:
        kwargs = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        return chunked_causal_lm_loss(logits, head, labels, chunk_size, **kwargs)

    head.forward = _pass_through  # an instance attribute: the class's forward is untouched
    model.loss_function = loss_function
    try:
        yield
    finally:
        del head.forward
        if had_loss:
            model.loss_function = previous
        else:
            del model.__dict__["_loss_function"]


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    """The head while the loss is chunked: the hidden states go to the loss, which applies the head itself."""
    return hidden


def log_unchunked(model: nn.Module, reason: str) -> None:
    """One line saying why this model's loss is not chunked."""
    log_rank0("loss_chunk_size: %s trains with its full logits (%s).", type(model).__name__, reason)
