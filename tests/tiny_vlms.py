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

from tests.tiny_models import TEXT_SHAPE, VOCAB

ROW_LENGTH = 16
IMAGE_TOKEN = VOCAB - 1
IMAGE_START, IMAGE_END = VOCAB - 3, VOCAB - 2
MIN_SPECIAL = VOCAB - 3  # text tokens stay below the image tokens


@dataclass(frozen=True)
class VlmFamily:
    """A tiny VLM: how to build it, a dataset row (with or without an image), and how rows batch."""

    name: str
    build: Callable[[], PreTrainedModel]
    image_inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]  # one image's processor outputs
    placeholder: list[int]  # the tokens one image takes in the text (start/end markers included)
    lm_lora_targets: str  # a regex naming the language model's projections only
    type_ids: str | None = None  # a per-token column marking image tokens, when the model reads one
    padded_images: bool = False  # Idefics3-style: a [rows, images, ...] tensor, text-only rows all zeros

    def row(self, index: int, has_image: bool) -> dict[str, Any]:
        """Row `index`: text tokens, led by the image's placeholders when it holds one."""
        g = torch.Generator().manual_seed(index)
        text = torch.randint(3, MIN_SPECIAL, (ROW_LENGTH,), generator=g)
        images = self.image_inputs(g) if has_image else {}
        if has_image:
            text[1 : 1 + len(self.placeholder)] = torch.tensor(self.placeholder)
        text[0] = 1
        labels = text.clone()
        labels[text >= MIN_SPECIAL] = -100
        row = {"input_ids": text.tolist(), "labels": labels.tolist(), "has_image": has_image}
        if self.type_ids:
            row[self.type_ids] = (text == IMAGE_TOKEN).long().tolist()
        row["images"] = {k: v.tolist() for k, v in images.items()}
        return row

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Stack the text; batch the images of the rows that hold one (no image key when none does)."""
        keys = ["input_ids", "labels"] + ([self.type_ids] if self.type_ids else [])
        batch = {k: torch.tensor([r[k] for r in rows]) for k in keys}
        with_images = [r["images"] for r in rows if r["has_image"]]
        if not with_images:
            return batch
        for key in with_images[0]:
            if self.padded_images:
                template = torch.tensor(with_images[0][key])
                per_row = [
                    torch.tensor(r["images"][key]) if r["has_image"] else torch.zeros_like(template) for r in rows
                ]
                batch[key] = torch.stack(per_row)
            else:
                batch[key] = torch.cat([torch.tensor(images[key]) for images in with_images])
        return batch


def _llava() -> PreTrainedModel:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(**{**_VISION, "patch_size": 4})
    config = LlavaConfig(
        vision_config=vision,
        text_config=_llama_text(),
        image_token_id=IMAGE_TOKEN,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config)


_TEXT = dict(**TEXT_SHAPE, bos_token_id=1, eos_token_id=2)
# A vision tower of 2 layers on 8x8 images cut into 2x2 patches.
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2
)


def _llama_text() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_TEXT)


def _qwen2_vl() -> PreTrainedModel:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(
            depth=2,
            embed_dim=16,
            num_heads=2,
            hidden_size=32,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            mlp_ratio=2,
        ),
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        video_token_id=VOCAB - 4,
    )
    return Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl() -> PreTrainedModel:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
            spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=8, fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        video_token_id=VOCAB - 4,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config)


def _gemma3() -> PreTrainedModel:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(**_TEXT, head_dim=8, sliding_window=8),
        vision_config=_VISION,
        mm_tokens_per_image=4,
        image_token_id=IMAGE_TOKEN,
        boi_token_index=IMAGE_START,
        eoi_token_index=IMAGE_END,
    )
    return Gemma3ForConditionalGeneration(config)


def _smolvlm() -> PreTrainedModel:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    config = SmolVLMConfig(
        text_config=dict(model_type="llama", **_TEXT), vision_config=_VISION, scale_factor=2, image_token_id=IMAGE_TOKEN
    )
    return SmolVLMForConditionalGeneration(config)


def _qwen_family(name: str, build: Callable[[], PreTrainedModel]) -> VlmFamily:
    """Qwen2-VL and Qwen2.5-VL take one image as 16 patches of 3 x 2 (frames) x 2 x 2 values, merged 2 x 2 into 4
    tokens between start/end markers, and a per-token type column for their 3-D positions."""
    return VlmFamily(
        name=name,
        build=build,
        image_inputs=lambda g: {
            "pixel_values": torch.randn(16, 24, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        },
        placeholder=[IMAGE_START, *[IMAGE_TOKEN] * 4, IMAGE_END],
        lm_lora_targets=r".*language_model.*\.(q_proj|v_proj)",
        type_ids="mm_token_type_ids",
    )


FAMILIES: dict[str, VlmFamily] = {
    "llava": VlmFamily(
        name="llava",
        build=_llava,
        image_inputs=lambda g: {"pixel_values": torch.randn(1, 3, 8, 8, generator=g)},
        placeholder=[IMAGE_TOKEN] * 4,  # (8 / 4)^2 patches, the CLS token dropped ("default" strategy)
        lm_lora_targets=r".*language_model.*\.(q_proj|v_proj)",
    ),
    "qwen2_vl": _qwen_family("qwen2_vl", _qwen2_vl),
    # transformers marks it accepts_loss_kwargs=False: the family that shows FSDP2Trainer normalizing by tokens anyway.
    "qwen2_5_vl": _qwen_family("qwen2_5_vl", _qwen2_5_vl),
    "gemma3": VlmFamily(
        name="gemma3",
        build=_gemma3,
        image_inputs=lambda g: {"pixel_values": torch.randn(1, 3, 8, 8, generator=g)},
        placeholder=[IMAGE_START, *[IMAGE_TOKEN] * 4, IMAGE_END],  # 16 patches pooled to mm_tokens_per_image
        lm_lora_targets=r".*language_model.*\.(q_proj|v_proj)",
        type_ids="token_type_ids",
    ),
    "smolvlm": VlmFamily(
        name="smolvlm",
        build=_smolvlm,
        image_inputs=lambda g: {"pixel_values": torch.randn(1, 3, 8, 8, generator=g)},
        placeholder=[IMAGE_TOKEN] * 4,  # 16 patches, pixel-shuffled by scale_factor 2
        lm_lora_targets=r".*text_model.*\.(q_proj|v_proj)",
        padded_images=True,
    ),
}


def save_tiny_vlm(name: str, directory: str, seed: int = 1234) -> str:
    """Build VLM `name` with a fixed seed and save it under `directory/name`; return the folder."""
    torch.manual_seed(seed)
    path = os.path.join(directory, name)
    FAMILIES[name].build().save_pretrained(path)
    return path
