"""How big a model is: the sizes the memory plan multiplies (parameters per part, KV per token).

Read from a model's config.json; for builtin models from their build settings; and, so that
``relax-launch plan`` can size a GPU job away from the cluster's filesystem, from the published
config.json of a few well-known models, picked by the directory's last name (``published.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from relax_launch.models.published import published_config
from relax_launch.models.registry import builtin_name, model_dir
from relax_launch.models.vision_sizes import (
    TINY_QWEN2_5_VL,
    VisionSize,
    processor_max_pixels,
)


@dataclass(frozen=True)
class ModelSize:
    """The dimensions memory depends on; ``source`` says where they were read."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int  # of a dense layer's MLP
    vocab_size: int
    tied_embeddings: bool
    source: str
    num_experts: int = 0  # routed experts of a MoE layer
    experts_per_token: int = 0
    expert_ffn_size: int = 0
    shared_expert_size: int = 0
    moe_layers: int = 0  # how many of the layers route to experts
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of queries and keys
    qkv_bias: bool = False  # Qwen2's (and Qwen2.5-VL's language model's) q, k, v biases
    vision: VisionSize | None = None  # a vision-language model's tower and merger

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str, max_pixels: int | None = None) -> ModelSize:
        """``cfg`` a config.json; a vision-language one's language model is its
        ``text_config`` (transformers 5) or its top level (the hub's layout)."""
        vision = None
        if "vision_config" in cfg:
            pixels = max_pixels or cfg.get("max_pixels")
            vision = VisionSize.from_hf_config(cfg["vision_config"], pixels)
            cfg = {**cfg, **(cfg.get("text_config") or {})}
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        layers = cfg["num_hidden_layers"]
        dense = set(cfg.get("mlp_only_layers") or ())
        step = cfg.get("decoder_sparse_step") or 1
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            num_layers=layers,
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg.get("intermediate_size") or 4 * cfg["hidden_size"],
            vocab_size=cfg["vocab_size"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            source=source,
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            expert_ffn_size=cfg.get("moe_intermediate_size", 0) if experts else 0,
            shared_expert_size=cfg.get("shared_expert_intermediate_size") or 0,
            moe_layers=moe_layers if experts else 0,
            qk_norm=cfg.get("model_type") in QK_NORM_TYPES
            or bool(set(cfg.get("architectures") or ()) & QK_NORM_ARCHITECTURES),
            qkv_bias=cfg.get("attention_bias", str(cfg.get("model_type")).startswith("qwen2")),
            vision=vision,
        )

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v and output projections."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = (q + 2 * kv) * self.qkv_bias
        return self.hidden_size * (q + 2 * kv) + bias + q * self.hidden_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.ffn_hidden_size  # gate, up, down

    @property
    def expert_params(self) -> int:
        """One MoE layer's routed experts, all of them."""
        return self.num_experts * 3 * self.hidden_size * self.expert_ffn_size

    @property
    def moe_shared_params(self) -> int:
        """One MoE layer's parts every rank holds: the router and the shared expert."""
        shared = 3 * self.hidden_size * self.shared_expert_size
        return self.hidden_size * self.num_experts + shared + (self.hidden_size if shared else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def vision_params(self) -> int:
        return self.vision.total_params if self.vision else 0

    @property
    def total_params(self) -> int:
        """Every parameter, a vision-language model's tower and merger included."""
        dense_layers = self.num_layers - self.moe_layers
        layers = self.num_layers * (self.attention_params + 2 * self.hidden_size)
        layers += dense_layers * self.dense_mlp_params
        layers += self.moe_layers * (self.expert_params + self.moe_shared_params)
        head = 0 if self.tied_embeddings else self.embedding_params
        return layers + self.embedding_params + head + self.hidden_size + self.vision_params


QK_NORM_TYPES = ("qwen3", "qwen3_moe")
QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}


# builtin models' sizes (relax_launch/models/build.py builds them with these)
_TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
}
_TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_SMOLLM2 = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
BUILTIN = {
    "smollm2-135m-instruct": _SMOLLM2,
    "smollm2-student": {**_SMOLLM2, "num_hidden_layers": 4},
    "tiny-llama": _TINY,
    "tiny-qwen2": {**_TINY, "tie_word_embeddings": True},
    "tiny-qwen3": {**_TINY, "head_dim": 32, "model_type": "qwen3"},
    "tiny-qwen3-moe": {**_TINY, **_TINY_MOE, "head_dim": 32, "model_type": "qwen3_moe"},
    "tiny-qwen2-moe": {**_TINY, **_TINY_MOE, "shared_expert_intermediate_size": 48},
    "tiny-qwen2.5-vl": TINY_QWEN2_5_VL,
}


def model_size(ref: str) -> ModelSize | None:
    """The size of model ``ref`` (builtin:NAME or a directory); None when nothing says it."""
    name = builtin_name(ref)
    if name is not None:
        known = BUILTIN.get(name)
        return ModelSize.from_hf_config(known, f"builtin:{name}") if known else None
    path = model_dir(ref) / "config.json"
    if path.is_file():
        pixels = processor_max_pixels(path.parent)
        return ModelSize.from_hf_config(json.loads(path.read_text()), str(path), pixels)
    published = published_config(ref)
    if published is None:
        return None
    return ModelSize.from_hf_config(published, f"{Path(ref).name}'s published config.json")
