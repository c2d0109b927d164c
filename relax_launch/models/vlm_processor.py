"""A Qwen2-VL family model's prompt with images -> token ids, image patches and patch grids, as
its transformers processor makes them, with the PIL image processor only.

transformers' ``AutoProcessor`` for Qwen2.5-VL also builds the video processor, which needs
torchvision (not installable beside the CPU torch wheel): this does the processor's two steps
itself. The image processor cuts each image into patches; the chat template's one
``<|image_pad|>`` per image is expanded to the image's token count (its patches / merge²).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_launch.models.registry import IMAGE_PAD


@dataclass
class VisionPrompt:
    """One prompt's model inputs: token ids, and for its images (in order) the patches
    [patches, channels x temporal x patch²] and grids [images, 3] (t, h, w in patches)."""

    ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


class VisionProcessor:
    """The tokenizer and PIL image processor of the model in ``model_dir``."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.merge = self.images.merge_size
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def encode_text(self, text: str, images: list[Any]) -> VisionPrompt:
        """``text`` (the chat template's output: one ``<|image_pad|>`` per image) with the PIL
        ``images`` it shows, in order."""
        if text.count(IMAGE_PAD) != len(images):
            raise ValueError(f"{text.count(IMAGE_PAD)} image placeholders for {len(images)} images")
        if not images:
            return VisionPrompt(self._ids(text), None, None)
        patches = self.images(images=images, return_tensors="pt")
        grids = patches["image_grid_thw"]
        parts = text.split(IMAGE_PAD)
        expanded = parts[0]
        for grid, part in zip(grids, parts[1:], strict=True):
            expanded += IMAGE_PAD * (int(grid.prod()) // self.merge**2) + part
        return VisionPrompt(self._ids(expanded), patches["pixel_values"], grids)

    def _ids(self, text: str) -> list[int]:
        """The ids of rendered ``text`` as the engine tokenizes it: the chat template wrote
        every special token already (SGLang tokenizes without adding any)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_chat(
        self, messages: list[dict[str, Any]], images: list[Any], add_generation_prompt: bool = True
    ) -> VisionPrompt:
        """Chat ``messages`` (content parts of type ``image``/``image_url`` and ``text``) with
        the PIL ``images`` their image parts show, in order."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.encode_text(text, images)
