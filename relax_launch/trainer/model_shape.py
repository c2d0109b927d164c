"""The architecture facts of a Hugging Face decoder (dense or mixture-of-experts) that the
conversion to Megatron-core and the Megatron config need, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_launch.models.registry import rope_type, trainable_problem

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


@dataclass(frozen=True)
class MoeShape:
    """The mixture-of-experts part of a model: which layers route, over how many experts."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # of each routed expert
    layers: tuple[int, ...]  # global indices of the MoE layers; the others are dense
    norm_topk_prob: bool  # the top-k routing weights renormalised to sum to 1
    shared_expert_size: int = 0  # Qwen2-MoE: a shared expert of this size, sigmoid-gated

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoeShape:
        dense = set(cfg.get("mlp_only_layers") or ())
        step = cfg.get("decoder_sparse_step") or 1
        layers = range(cfg["num_hidden_layers"])
        return cls(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            topk=cfg["num_experts_per_tok"],
            ffn_hidden_size=cfg["moe_intermediate_size"],
            layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_size=cfg.get("shared_expert_intermediate_size") or 0,
        )


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts the conversion and the Megatron config need.

    One decoder family covers Llama (1-3), Qwen2/Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm
    over each head, ``head_dim`` free of hidden / heads), and their MoE kin (``moe``).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_type: str = "default"
    moe: MoeShape | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """The shape of a Hugging Face config.json; refuses what the conversion cannot map."""
        problem = trainable_problem(cfg)
        if problem:
            raise ValueError(problem)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        architecture = cfg["architectures"][0]
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            qkv_bias=architecture == "Qwen2ForCausalLM"
            or (architecture == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope_type=rope_type(cfg),
            moe=MoeShape.from_hf_config(cfg) if architecture in MOE_ARCHITECTURES else None,
        )

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers
