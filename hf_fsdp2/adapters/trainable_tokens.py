"""peft's trainable tokens (`LoraConfig(trainable_token_indices=...)`, `TrainableTokensConfig`) on a meta skeleton:
their rows start as the base embedding's rows, which only the checkpoint holds, so they are read from it.

peft keeps two copies of the chosen rows per adapter: the trained `trainable_tokens_delta` (initialized as the base
rows, or randomly with `init_weights=False`) and the frozen `trainable_tokens_original` (always the base rows). A
replay of peft on a weightless stand-in gets everything else right (shapes, dtypes, random draws in order) but reads
zeros for the rows; this module supplies the rows. It knows nothing of sharding: the rows are a few full vectors.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

import torch
from torch import nn

_DELTA, _ORIGINAL = "trainable_tokens_delta", "trainable_tokens_original"
RowReader = Callable[[str, list[int]], torch.Tensor]


def token_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's `TrainableTokensLayer`s that own their rows, by module name (a layer tied to another owns none)."""
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, TrainableTokensLayer) and module.tied_adapter is None
    }


def starts_from_base_rows(model: nn.Module, adapter: str) -> bool:
    """Whether peft initialized the adapter's trained rows as copies of the base rows (else: random).

    `trainable_token_indices` on other methods always copies (peft passes no `init_weights`); the standalone
    trainable-tokens method follows its config's `init_weights`.
    """
    config = model.peft_config[adapter]
    return config.peft_type.value != "TRAINABLE_TOKENS" or bool(config.init_weights)


def rows_read_from_the_checkpoint(model: nn.Module) -> set[str]:
    """Names of the tensors `initial_token_values` gives: their values come from the checkpoint, not from a replay."""
    names = set()
    for layer_name, layer in token_layers(model).items():
        for adapter in layer.token_indices:
            names.add(f"{layer_name}.{_ORIGINAL}.{adapter}")
            if starts_from_base_rows(model, adapter):
                names.add(f"{layer_name}.{_DELTA}.{adapter}")
    return names


def initial_token_values(model: nn.Module, read_rows: RowReader) -> dict[str, torch.Tensor]:
    """The values peft gives trainable tokens on a real base, by `model`'s tensor names.

    `read_rows(name, indices)` returns the base rows `indices` of the base tensor `name` (a name of `model`).
    """
    values: dict[str, torch.Tensor] = {}
    for layer_name, layer in token_layers(model).items():
        base = f"{layer_name}.base_layer.weight"
        dtype = layer.base_layer.weight.dtype
        for adapter, indices in layer.token_indices.items():
            rows = read_rows(base, list(indices)).to(dtype)
            values[f"{layer_name}.{_ORIGINAL}.{adapter}"] = rows
            if starts_from_base_rows(model, adapter):
                values[f"{layer_name}.{_DELTA}.{adapter}"] = rows.clone()
    return values


def checkpoint_row_reader(path: str, keys: dict[str, str]) -> RowReader:
    """A `RowReader` over the safetensors files in `path`; `keys` maps model names to checkpoint keys.

    Raises:
        ValueError: (when called) if the base tensor has no checkpoint key, or an index is outside its rows.
    """
    from safetensors import safe_open

    def read(name: str, indices: list[int]) -> torch.Tensor:
        key = keys.get(name)
        if key is None:
            raise ValueError(
                f"{name} is not in the checkpoint at {path}, so the rows of trainable_token_indices cannot start "
                "from it. Pass a model object with real weights, or train the embedding with modules_to_save."
            )
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                if key in f.keys():
                    return _rows(f.get_slice(key), indices, name)
        raise ValueError(f"{key} is in no safetensors file of {path}")

    return read


def _rows(tensor_slice: object, indices: list[int], name: str) -> torch.Tensor:
    """Rows `indices` of a safetensors slice, read one row at a time (only those bytes leave the file)."""
    count = tensor_slice.get_shape()[0]  # type: ignore[attr-defined]
    bad = [i for i in indices if not 0 <= i < count]
    if bad:
        raise ValueError(f"trainable_token_indices {bad} are outside {name}'s {count} rows.")
    return torch.cat([tensor_slice[i : i + 1] for i in indices])  # type: ignore[index]
