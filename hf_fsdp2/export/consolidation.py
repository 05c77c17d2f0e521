"""Offline consolidation (`consolidate`, the `hf-fsdp2 consolidate` CLI): a sharded checkpoint, ours or Trainer +
Accelerate's, streamed into a Hugging Face folder that `from_pretrained` loads. Peak memory is about twice the
largest tensor (reads of up to that many bytes, a layer or so), not the model. The live model's export is
`export.live`.

NOTE: this module and what it imports stay clear of transformers' modeling code, peft, datasets and the trainer
stack, so the command starts as fast as `accelerate merge-weights` does (tests/test_consolidate.py checks the
modules it imports).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoints.disk_space import check_room, raise_if_write_failed
from ..checkpoints.distcp_reader import SafeFileSystemReader
from ..checkpoints.sharded import MODEL_KEY, load_in_place, read_metadata, validate_checkpoint
from ..config import resolve_dtype
from .hf_folder import TensorSpec, export_dtype, prepare_output, publish, write_order, write_weights

# Files beside the weights that make a folder loadable (config) and usable (generation, tokenizer).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def consolidate(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    overwrite: bool = False,
) -> str:
    """Turn a sharded checkpoint (ours or Trainer + Accelerate's) into a `from_pretrained`-ready folder.

    Raises:
        ValueError: when the checkpoint is incomplete, corrupt, or has no model tensors or config.json, or
            `output_dir` is not empty and `overwrite` is False.
    """
    directory = validate_checkpoint(checkpoint_dir)
    target = resolve_dtype(dtype)
    stored = {
        key[len(MODEL_KEY) + 1 :]: md
        for key, md in read_metadata(directory).state_dict_metadata.items()
        if key.startswith(MODEL_KEY + ".") and isinstance(md, TensorStorageMetadata)
    }
    if not stored:
        raise ValueError(f"{directory} holds no model tensors (is it an optimizer_0 folder?).")
    source = _model_files_dir(checkpoint_dir, directory)
    specs = [TensorSpec(k, tuple(md.size), export_dtype(md.properties.dtype, target)) for k, md in stored.items()]
    specs = write_order(specs, max_shard_size)  # batches are read in the order the files are written
    # NOTE: this process alone writes; one rank of a running job may call it, so no collective.
    need = check_room(output_dir, sum(spec.nbytes for spec in specs), what="export", collective=False)
    staging = prepare_output(output_dir, overwrite)
    reader = SafeFileSystemReader(directory, cache_metadata=True)
    batches = read_batches(specs, max(spec.nbytes for spec in specs))
    loaded: dict[str, torch.Tensor] = {}

    def fetch(spec: TensorSpec) -> torch.Tensor:
        if spec.name not in loaded:
            batch = {s.name: torch.empty(s.shape, dtype=stored[s.name].properties.dtype) for s in next(batches)}
            load_in_place({MODEL_KEY: batch}, directory, reader, collective=False)
            loaded.update(batch)
        return loaded.pop(spec.name)

    try:
        write_weights(staging, specs, fetch, max_shard_size)
        _copy_model_files(source, staging, target)
    except OSError as error:
        raise_if_write_failed(error, output_dir, staging, need, what="export", collective=False)  # the clear error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, output_dir)
    return output_dir


def read_batches(specs: list[TensorSpec], budget: int) -> Iterator[list[TensorSpec]]:
    """Consecutive tensors, in write order, grouped up to `budget` bytes of storage per DCP read.

    NOTE: one DCP request per tensor spent ~2 ms each on planning; with the budget set to the largest
    tensor, a whole decoder layer comes in one request while the peak stays what reading that tensor
    alone already costs.
    """
    batch: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if batch and size + spec.nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(spec)
        size += spec.nbytes
    if batch:
        yield batch


def _model_files_dir(checkpoint_dir: str, directory: str) -> str:
    """Find config.json: in the checkpoint-N folder (ours, or when given its pytorch_model_fsdp_0)."""
    for candidate in (checkpoint_dir, os.path.dirname(os.path.abspath(directory))):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    raise ValueError(
        f"no config.json beside {directory}; from_pretrained needs it. Copy the model's config.json into the "
        "checkpoint folder and run again. A model that is not a transformers PreTrainedModel (a SentenceTransformer) "
        "has none on purpose: its folder is written in its own format by trainer.save_model(dir) after "
        "trainer.train(resume_from_checkpoint=...)."
    )


def _copy_model_files(source: str, destination: str, dtype: torch.dtype | None) -> None:
    """Copy config/generation/tokenizer files; config.json records the export dtype and real class names."""
    for name in MODEL_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), os.path.join(destination, name))
    _mend_config(os.path.join(destination, "config.json"), dtype)


def _mend_config(path: str, dtype: torch.dtype | None) -> None:
    """Make a copied config.json say what `save_pretrained` would: the dtype written, the model's own class.

    Checkpoints written by earlier hf_fsdp2 versions named fully_shard's generated `FSDP<Class>` in `architectures`;
    the prefix is dropped as transformers' own `save_pretrained` drops it.
    """
    with open(path) as f:
        config = json.load(f)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    if config.get("architectures"):
        config["architectures"] = [name.removeprefix("FSDP") for name in config["architectures"]]
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
