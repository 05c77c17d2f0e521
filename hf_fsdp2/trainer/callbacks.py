"""Thin TrainerCallbacks that decide *when*; `consolidate` and `checkpoint` know *how*."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..export.live import save_pretrained_sharded


class ConsolidateCallback(TrainerCallback):
    """At the end of training, write the model as a `from_pretrained`-ready folder (a PEFT model: its adapter).

    Args:
        output_dir: where to write; default `TrainingArguments.output_dir`.
        dtype: export dtype (e.g. "bfloat16"); default the parameters' own.
        max_shard_size: largest safetensors file.
        merge_adapters: for a PEFT model, write the merged full model instead of the adapter folder.

    A model that is not a `PreTrainedModel` is written in its own format: `trainer_save`, which `FSDP2Mixin` sets to
    its trainer subclass's own `_save` when it has one, else the model's own save method.
    """

    trainer_save: Callable[[str], None] | None = None

    def __init__(
        self,
        output_dir: str | None = None,
        dtype: str | None = None,
        max_shard_size: str = "5GB",
        merge_adapters: bool = False,
    ):
        self.output_dir = output_dir
        self.dtype = dtype
        self.max_shard_size = max_shard_size
        self.merge_adapters = merge_adapters

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        save_pretrained_sharded(
            kwargs["model"],
            self.output_dir or args.output_dir,
            processing_class=kwargs.get("processing_class"),
            dtype=self.dtype,
            max_shard_size=self.max_shard_size,
            merge_adapters=self.merge_adapters,
            trainer_save=self.trainer_save,
        )
