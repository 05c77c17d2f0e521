"""Sequence parallelism (`FSDP2Config(sequence_parallel_size=N)`): groups of N consecutive ranks share the work of
one row at a time, each holding a contiguous slice of it (attention: `ulysses_attention`).

The math of the run does not change: every rank still draws its own rows, and a group processes its members'
rows one after another, each split N ways; so the global batch, the steps and the schedule are those of the
same ranks without the switch, and only memory and speed move. Labels are shifted over the whole row before
it is cut, position ids are cut (never rebuilt), rows are padded to a multiple of N with ignored targets, and
each part's loss is a sum over its slice divided by the token count Trainer gives the member whose rows they
are — so summed over the group it is that member's loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..meshes import mesh_carrying_cpu
from .chunked_loss import IGNORE_INDEX, shifted_labels
from .ulysses_attention import SUPPORTED_ATTENTION, RowLayout, documents_of

# Decoder-only families whose attention goes through the AttentionInterface with rotary positions from
# position_ids and no cross-token state outside attention (tested in tests/test_sequence_parallel.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
# Batch keys a part carries (sliced), and keys that only restate the packing the position ids already give.
_ROW_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@dataclass
class Part:
    """One slice of one member's rows: the model's inputs, the whole rows' layout, and the member's token count."""

    inputs: dict[str, torch.Tensor]
    layout: RowLayout
    num_items_in_batch: Any


class SequenceParallel:
    """The group this rank belongs to, and how a micro-batch becomes the group's parts."""

    def __init__(self, size: int, implementation: str) -> None:
        world = dist.get_world_size()
        mesh = mesh_carrying_cpu((world // size, size), ("data", "sequence"))
        self.size = size
        self.group = mesh.get_group("sequence")
        self.rank = dist.get_rank(self.group)
        self.implementation = implementation

    def parts(self, inputs: dict[str, Any], num_items_in_batch: Any) -> Iterator[Part]:
        """This rank's slice of each member's micro-batch, member by member (the same order on every rank)."""
        check_inputs(inputs)
        members: list[Any] = [None] * self.size
        # NOTE: the token count crosses as a Python number: Trainer's is a tensor on the accelerator, and a pickled
        # CUDA tensor is unpickled onto the sender's device on every rank. It becomes a tensor like ours below.
        count = num_items_in_batch.item() if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        local = ({k: v.cpu() for k, v in inputs.items() if k in _ROW_KEYS}, count)
        dist.all_gather_object(members, local, group=self.group)
        for batch, num_items in members:
            if num_items is None:
                raise RuntimeError(
                    "sequence_parallel_size needs the token count Trainer passes to causal LM losses "
                    "(num_items_in_batch), and this step had none; train a causal LM with labels."
                )
            if torch.is_tensor(num_items_in_batch):
                num_items = torch.tensor(num_items, dtype=num_items_in_batch.dtype, device=num_items_in_batch.device)
            rows = split_row(batch, self.size, self.rank)
            layout = RowLayout(self.group, self.size, self.implementation, documents_of(rows.pop("whole_positions")))
            yield Part(rows, layout, num_items)


def split_row(batch: dict[str, torch.Tensor], size: int, rank: int) -> dict[str, torch.Tensor]:
    """`rank`'s contiguous slice of rows padded to a multiple of `size`, plus the whole padded rows' positions.

    Raises:
        ValueError: for left padding or holes in an attention mask, or labels on padding (not exact when split).
    """
    input_ids = batch["input_ids"]
    rows, length = input_ids.shape
    labels = batch.get("labels")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length).expand(rows, length)  # what the model does without them
    positions = positions.expand(rows, length)
    shift_labels = batch.get("shift_labels")
    if shift_labels is None and labels is not None:
        shift_labels = shifted_labels(labels)  # over the whole row, before the cut
    check_padding(batch.get("attention_mask"), labels)
    pad = -length % size
    padded = {
        "input_ids": F.pad(input_ids, (0, pad), value=0),
        "position_ids": torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1)], dim=1),
    }
    if labels is not None:
        padded["labels"] = F.pad(labels, (0, pad), value=IGNORE_INDEX)
        padded["shift_labels"] = F.pad(shift_labels, (0, pad), value=IGNORE_INDEX)
    piece = (length + pad) // size
    cut = slice(rank * piece, (rank + 1) * piece)
    part = {k: v[:, cut].contiguous() for k, v in padded.items()}
    part["whole_positions"] = padded["position_ids"]
    return part


def check_padding(attention_mask: torch.Tensor | None, labels: torch.Tensor | None) -> None:
    """Right padding is exact without a mask (pad tokens come after every real one); anything else is refused.

    Raises:
        ValueError: for left padding or holes, and for labels on padded positions.
    """
    if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.all()):
        return
    keep = attention_mask.bool()
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ValueError(
            "sequence_parallel_size: this batch's attention_mask has padding before real tokens (left padding or "
            "holes), which a split row cannot reproduce. Pad on the right (tokenizer.padding_side='right') or, "
            "better, pack rows without padding: DataCollatorWithFlattening, or TRL's SFTConfig(packing=True) / "
            "padding_free=True."
        )
    if labels is not None and bool((labels[~keep] != IGNORE_INDEX).any()):
        raise ValueError(
            "sequence_parallel_size: labels on padded positions must be -100 (DataCollatorForLanguageModeling does "
            "this); set them to -100 or pack rows without padding (DataCollatorWithFlattening)."
        )


def check_inputs(inputs: dict[str, Any]) -> None:
    """Refuse batch keys a split row cannot carry (images, embeddings), naming them."""
    unknown = sorted(k for k in inputs if k not in _ROW_KEYS + _PACKING_KEYS)
    if unknown or "input_ids" not in inputs:
        raise ValueError(
            f"sequence_parallel_size splits rows of input_ids (with labels, position_ids, attention_mask); this "
            f"batch has {sorted(inputs)}, and {unknown or ['no input_ids']} cannot be split. Train text-only causal LM "
            "batches with it, or set sequence_parallel_size=1."
        )


def check_model(model: nn.Module, size: int, world_size: int) -> str:
    """The model's own attention implementation, after checking sequence parallelism can run it exactly.

    Raises:
        ValueError: naming the world size, the model family, the attention implementation or the head counts.
    """
    if world_size % size:
        raise ValueError(
            f"sequence_parallel_size={size} does not divide the world size {world_size}; choose a divisor "
            f"(groups of N consecutive ranks share each row)."
        )
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"sequence_parallel_size: {type(model).__name__} (model_type={model_type!r}) is not supported; it runs "
            f"{list(SUPPORTED_MODEL_TYPES)} exactly. Set sequence_parallel_size=1 for this model."
        )
    implementation = config._attn_implementation or "eager"
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"sequence_parallel_size: attn_implementation={implementation!r} is not supported; load the model with "
            f"one of {list(SUPPORTED_ATTENTION)}."
        )
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 0
    if heads % size:
        raise ValueError(
            f"sequence_parallel_size={size} must divide the number of attention heads ({heads} query heads, "
            f"{kv_heads} key/value heads): each rank attends with heads / N of them. Choose a divisor of {heads}."
        )
    return implementation
