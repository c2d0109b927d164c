"""Prompt: one row of the RL data, as the loop draws it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_launch.rl.vision_prompts import PromptImages


@dataclass(frozen=True)
class Prompt:
    index: int
    messages: tuple[dict[str, Any], ...]  # content: text, or parts (text, image, image_url)
    label: str | None = None
    data_source: str = "default"
    meta: dict | None = None  # what a row's reward needs beyond its label (reasoning-gym's entry)
    # a prompt with images, once the feed has encoded them for a vision-language policy
    images: PromptImages | None = None
