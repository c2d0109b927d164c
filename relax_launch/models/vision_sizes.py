"""How big a vision-language model's vision part is (Qwen2.5-VL: the vision tower and its patch
merger), and how many patches an image becomes: what the memory plan adds to the language
model's size (``models/sizes.py``).

Read from a config.json's ``vision_config`` and the image processor's ``max_pixels``
(``preprocessor_config.json``: ``max_pixels``, or transformers 5's ``size.longest_edge``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# transformers' Qwen2VLImageProcessor default (28 x 28 x 1280): where no processor config says
DEFAULT_MAX_PIXELS = 1003520


@dataclass(frozen=True)
class VisionSize:
    """Qwen2.5-VL's vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``):
    a Conv3d patch embedding, ``depth`` blocks (two RMSNorms, fused qkv and projection with
    biases, a SwiGLU MLP with biases) and the merger (an RMSNorm, then two linears over
    ``merge_size``² patches into the language model's hidden size)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    max_pixels: int = DEFAULT_MAX_PIXELS  # the image processor's: the largest image it keeps

    @classmethod
    def from_hf_config(cls, vision: dict, max_pixels: int | None) -> VisionSize:
        return cls(
            depth=vision["depth"],
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_heads=vision["num_heads"],
            out_hidden_size=vision["out_hidden_size"],
            patch_size=vision.get("patch_size", 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            merge_size=vision.get("spatial_merge_size", 2),
            in_channels=vision.get("in_channels") or vision.get("in_chans") or 3,
            max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
        )

    @property
    def patch_values(self) -> int:
        """One patch's pixel values: channels x frames x patch²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def block_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attention = h * 3 * h + 3 * h + h * h + h  # qkv and proj, with biases
        mlp = 2 * (h * i + i) + i * h + h  # gate, up, down, with biases
        return attention + mlp + 2 * h  # and the two norms

    @property
    def merged_size(self) -> int:
        """The merger's width: merge² patches side by side."""
        return self.hidden_size * self.merge_size**2

    @property
    def merger_params(self) -> int:
        m = self.merged_size
        return self.hidden_size + m * m + m + m * self.out_hidden_size + self.out_hidden_size

    @property
    def total_params(self) -> int:
        embedding = self.patch_values * self.hidden_size  # Conv3d without bias
        return embedding + self.depth * self.block_params + self.merger_params

    def image_tokens(self, pixels: float) -> int:
        """The language model's tokens for an image of ``pixels`` pixels (at most the
        processor's ``max_pixels``): one per merge x merge patches."""
        unit = (self.patch_size * self.merge_size) ** 2
        return math.ceil(min(pixels, self.max_pixels) / unit)


def processor_max_pixels(model_dir: Path) -> int | None:
    """``max_pixels`` of the image processor saved in ``model_dir``; None without one."""
    path = model_dir / "preprocessor_config.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved.get("max_pixels") or (saved.get("size") or {}).get("longest_edge")


# Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json (its Hugging Face page:
# max_pixels 12845056), for planning without the files
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_chans": 3,
    },
    "max_pixels": 12845056,
}
# builtin:tiny-qwen2.5-vl (models/build_vlm.py builds it with these)
TINY_QWEN2_5_VL = {
    "model_type": "qwen2_5_vl",
    "text_config": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 384,
    },
    "tie_word_embeddings": True,
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
    },
    "max_pixels": 112 * 112,
}
