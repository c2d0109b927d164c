"""Build the tiny random Qwen2.5-VL: a 2-block vision tower, its patch merger, and a 2-layer
Qwen2 language model with multimodal RoPE, with a locally trained tokenizer and a PIL image
processor (no downloads, no torchvision).

Images are cut into 14-pixel patches (2 x 2 of them merge into one token), so a 56 x 56 image
is 4 image tokens; ``min_pixels``/``max_pixels`` keep every image between 28 x 28 and 112 x 112
(4 to 16 tokens) so the CPU engine and trainer stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax_launch.models.tokenizer import train_tiny_tokenizer

# Qwen2-VL's vision markers, special tokens of the tokenizer
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template in miniature: a message's content is a string or a list of parts;
# each image part becomes <|vision_start|><|image_pad|><|vision_end|> (the processor expands
# the pad to one token per merged patch)
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VL_CORPUS = [
    "How many red circles are in the image? The answer is 3.",
    "Which shape is larger, the blue square or the green triangle? The blue square.",
    "Count the shapes: 1 2 3 4 5 6 7 8 9 0. Answer in the format <answer>4</answer>.",
    "The image shows a yellow circle left of a red square on a white background.",
]
PIXELS = {"min_pixels": 28 * 28, "max_pixels": 112 * 112}
VOCAB_SIZE = 384


def tiny_vl_config(tokenizer: Any, *, text: dict | None = None, vision: dict | None = None) -> Any:
    """The tiny Qwen2.5-VL config: text hidden 64 (4 heads of 16, 2 KV heads), mrope sections
    [2, 3, 3] of the 8 rotary frequency pairs; vision hidden 32, 2 blocks, the second of full
    attention (the first windowed), merged into the text hidden size. ``text``/``vision``
    replace its fields (a larger model with the same tokenizer and markers)."""
    from transformers import Qwen2_5_VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_SPECIALS}
    text_config = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    } | (text or {})
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    } | (vision or {})
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=text_config["tie_word_embeddings"],
        torch_dtype="float32",
    )


def build_tiny_qwen2_5_vl(
    out: Path, seed: int = 0, *, text: dict | None = None, vision: dict | None = None
) -> None:
    """Write the tiny random Qwen2.5-VL (weights, config, tokenizer, processor) to ``out``;
    ``text``/``vision`` replace fields of its config (``tiny_vl_config``)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_vl_tokenizer()
    config = tiny_vl_config(tokenizer, text=text, vision=vision)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # init leaves biases at 0 and norms at 1: a dropped one would not show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    save_processor_config(out)
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    path.write_text(json.dumps(saved, indent=2))


def save_processor_config(out: Path) -> None:
    """The image processor's and processor's configs: the PIL image processor (the
    torchvision one does not load beside the CPU torch wheel)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    image = Qwen2VLImageProcessorPil(**PIXELS)
    image.save_pretrained(out)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["processor_class"] = "Qwen2_5_VLProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def tiny_vl_tokenizer() -> Any:
    """A byte-level BPE tokenizer with Qwen2-VL's chat and vision special tokens."""
    return train_tiny_tokenizer(
        TINY_VL_CORPUS, VOCAB_SIZE, VL_CHAT_TEMPLATE, extra_specials=tuple(VISION_SPECIALS)
    )
