"""The published config.json of a few well-known models (their Hugging Face pages), picked by a
directory's last name: what ``relax-launch plan`` knows of a model away from the cluster's
filesystem. One table for its size (``models/sizes.py``) and for whether it is a
vision-language model (``models/registry.is_vision_language``)."""

from __future__ import annotations

from pathlib import Path

from relax_launch.models.vision_sizes import QWEN2_5_VL_7B


def _qwen3(layers: int, hidden: int, heads: int, kv: int, ffn: int, **moe: int) -> dict:
    return {
        "model_type": "qwen3_moe" if moe else "qwen3",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "intermediate_size": ffn,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        **moe,
    }


PUBLISHED = {
    "Qwen3-8B": _qwen3(36, 4096, 32, 8, 12288),
    "Qwen3-32B": _qwen3(64, 5120, 64, 8, 25600),
    "Qwen3-30B-A3B": _qwen3(
        48, 2048, 32, 4, 6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768
    ),
    "Qwen2.5-VL-7B-Instruct": QWEN2_5_VL_7B,
    "Qwen3-235B-A22B": _qwen3(
        94, 4096, 64, 4, 12288, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536
    ),
}


def published_config(ref: str) -> dict | None:
    """The published config.json of the model directory ``ref`` names, or None."""
    return PUBLISHED.get(Path(ref).name)
