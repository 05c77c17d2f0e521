"""Tiny vision-language models built from configs, with rows and a collator each: nothing is downloaded.

Each family knows how its processor would lay out a row (image placeholder tokens, pixel tensors) so that
tests can build mixed image/text batches without a processor or an image file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from tests.tiny_models import VOCAB

ROW_LENGTH = 16
IMAGE_TOKEN = VOCAB - 1


@dataclass(frozen=True)
class VlmFamily:
    """A tiny VLM: how to build it, a dataset row (with or without an image), and how rows batch."""

    name: str
    build: Callable[[], PreTrainedModel]
    image_inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]  # one image's processor outputs
    image_tokens: int  # placeholder tokens one image takes in the text
    lm_lora_targets: str  # a regex naming the language model's projections only

    def row(self, index: int, has_image: bool) -> dict[str, Any]:
        """Row `index`: text tokens, led by the image's placeholders when it holds one."""
        g = torch.Generator().manual_seed(index)
        text = torch.randint(3, IMAGE_TOKEN, (ROW_LENGTH,), generator=g)
        images = self.image_inputs(g) if has_image else {}
        if has_image:
            text[1 : 1 + self.image_tokens] = IMAGE_TOKEN
        text[0] = 1
        labels = text.clone()
        labels[text == IMAGE_TOKEN] = -100
        pixels = {k: v.tolist() for k, v in images.items()}
        return {"input_ids": text.tolist(), "labels": labels.tolist(), "has_image": has_image, "images": pixels}

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Stack the text; concatenate the images of the rows that hold one (no key when none does)."""
        batch = {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "labels")}
        with_images = [r["images"] for r in rows if r["has_image"]]
        for key in with_images[0] if with_images else ():
            batch[key] = torch.cat([torch.tensor(images[key]) for images in with_images])
        return batch


def _llava() -> PreTrainedModel:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_llama_text(),
        image_token_id=IMAGE_TOKEN,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config)


def _llama_text() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )


FAMILIES: dict[str, VlmFamily] = {
    "llava": VlmFamily(
        name="llava",
        build=_llava,
        image_inputs=lambda g: {"pixel_values": torch.randn(1, 3, 8, 8, generator=g)},
        image_tokens=4,  # (8 / 4)^2 patches, the CLS token dropped ("default" strategy)
        lm_lora_targets=r".*language_model.*\.(q_proj|v_proj)",
    ),
}


def save_tiny_vlm(name: str, directory: str, seed: int = 1234) -> str:
    """Build VLM `name` with a fixed seed and save it under `directory/name`; return the folder."""
    torch.manual_seed(seed)
    path = os.path.join(directory, name)
    FAMILIES[name].build().save_pretrained(path)
    return path
