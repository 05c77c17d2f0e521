"""Shared fixtures: tiny models saved once per session."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import save_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """Return a function name -> folder of a saved tiny model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[tuple[str, bool], str] = {}

    def get(name: str, safetensors: bool = True) -> str:
        key = (name, safetensors)
        if key not in cache:
            cache[key] = save_tiny(name, str(root), safe_serialization=safetensors)
        return cache[key]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
