"""Model references: builtin:NAME or a directory, and the shape facts preflight checks.

Facts of builtin models are tabled here so that ``relax-launch plan`` can check them without
building the model (which needs torch). ``relax_launch.models.build`` makes the directories.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from relax_launch.models.published import published_config

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class ModelFacts:
    """The parts of a Hugging Face config that placement and weight sync depend on."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    architecture: str = "LlamaForCausalLM"  # config.json's "architectures"[0]; "" when missing
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    tied_embeddings: bool = field(default=False, compare=False)  # the head is the embedding
    # Why the trainer cannot convert this model (``trainable_problem``); None when it can.
    not_trainable: str | None = field(default=None, compare=False)

    @property
    def has_architectures(self) -> bool:
        return bool(self.architecture)


# the tiny random models' shape (models/build.py), 2 layers of hidden size 64
TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
}
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ModelFacts(
        num_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tied_embeddings=True,
    ),
    # The first 4 of SmolLM2's 30 layers with its embeddings and tokenizer: a distillation student.
    "smollm2-student": ModelFacts(
        num_layers=4,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tied_embeddings=True,
    ),
    "tiny-llama": ModelFacts(**TINY),
    # Qwen2.5's shape in miniature: q/k/v biases, tied embeddings.
    "tiny-qwen2": ModelFacts(**TINY, architecture="Qwen2ForCausalLM", tied_embeddings=True),
    # Qwen3's: q/k RMSNorm, no biases, head_dim (32) != hidden_size / heads (16).
    "tiny-qwen3": ModelFacts(**TINY, architecture="Qwen3ForCausalLM"),
    # Qwen3-MoE's: 4 routed experts, top-2, normalised top-k weights, q/k norms.
    "tiny-qwen3-moe": ModelFacts(**TINY, architecture="Qwen3MoeForCausalLM", num_experts=4),
    # Qwen2-MoE's (Qwen1.5-MoE): 4 routed experts, top-2, a gated shared expert, q/k/v biases.
    "tiny-qwen2-moe": ModelFacts(**TINY, architecture="Qwen2MoeForCausalLM", num_experts=4),
    # Qwen2.5-VL's: a 2-block vision tower and merger, multimodal RoPE (models/build_vlm.py)
    "tiny-qwen2.5-vl": ModelFacts(
        **(TINY | {"vocab_size": 384}),
        architecture="Qwen2_5_VLForConditionalGeneration",
        tied_embeddings=True,
    ),
}
# What the trainer converts to Megatron-core and syncs back (trainer/hf_conversion.py); engines
# that only serve (teacher, genrm) take any architecture SGLang runs.
TRAINABLE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
)
# Vision-language models the trainer builds (trainer/vlm_model.py; docs/vlm.md): their
# language model is checked when the trainer reads the config (trainer/vlm_conversion.py).
VISION_LANGUAGE_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
IMAGE_PAD = "<|image_pad|>"  # their image placeholder token (Qwen2-VL family)
# RoPE variants that change only the rotary frequencies (trainer/model.py applies them).
TRAINABLE_ROPE_TYPES = ("default", "linear", "llama3")


def cache_dir() -> Path:
    """Where built models are cached: $RELAX_LAUNCH_CACHE or ~/.cache/relax-launch."""
    return Path(os.environ.get("RELAX_LAUNCH_CACHE") or Path.home() / ".cache" / "relax-launch")


def builtin_name(ref: str) -> str | None:
    """The builtin model name of ``ref``, or None when ``ref`` is a directory."""
    return ref[len(BUILTIN_PREFIX) :] if ref.startswith(BUILTIN_PREFIX) else None


def model_dir(ref: str) -> Path:
    """The directory ``ref`` names (a builtin model's cache directory, built or not)."""
    name = builtin_name(ref)
    return cache_dir() / "models" / name if name is not None else Path(ref).expanduser()


def model_facts(ref: str) -> ModelFacts | None:
    """Shape facts of ``ref``; None when it is a directory without a readable config.json."""
    name = builtin_name(ref)
    if name is not None:
        return BUILTIN_MODELS.get(name)
    path = model_dir(ref) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    heads = cfg.get("num_attention_heads", 0)
    return ModelFacts(
        num_layers=cfg.get("num_hidden_layers", 0),
        hidden_size=cfg.get("hidden_size", 0),
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg.get("vocab_size", 0),
        architecture=(cfg.get("architectures") or [""])[0],
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        not_trainable=trainable_problem(cfg),
    )


def rope_type(cfg: dict) -> str:
    """The RoPE scaling type a Hugging Face config.json names (transformers' older
    ``rope_scaling`` or newer ``rope_parameters``; "type" is the older key of "rope_type")."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope.get("rope_type") or rope.get("type") or "default"


def trainable_problem(cfg: dict) -> str | None:
    """Why the trainer cannot convert the model of Hugging Face ``cfg`` exactly, or None.

    Refused rather than approximated: a part the conversion does not map would be dropped
    silently (biases, sliding windows) or change the model's outputs (RoPE variants).
    """
    architecture = (cfg.get("architectures") or ["(none)"])[0]
    if architecture in VISION_LANGUAGE_ARCHITECTURES:
        return None
    if architecture not in TRAINABLE_ARCHITECTURES:
        return (
            f"architecture {architecture} is not one the trainer converts to Megatron-core; "
            f"supported: {', '.join(TRAINABLE_ARCHITECTURES)}"
        )
    rope = rope_type(cfg)
    if rope not in TRAINABLE_ROPE_TYPES:
        return (
            f"RoPE scaling {rope!r} is not supported by the trainer; supported: "
            f"{', '.join(TRAINABLE_ROPE_TYPES)}"
        )
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if cfg.get(flag):
            return f"{architecture} with {flag}=true is not supported by the trainer's conversion"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act={cfg['hidden_act']!r} is not supported (the trainer uses SwiGLU/silu)"
    return None


def is_vision_language(ref: str) -> bool:
    """Whether ``ref`` names a vision-language model: by its facts, or where there are none
    (a directory away from this machine) by its published config.json, as ``model_size`` sizes
    it (``models/published.py``); False when neither says."""
    facts = model_facts(ref)
    if facts is not None:
        return facts.architecture in VISION_LANGUAGE_ARCHITECTURES
    published = published_config(ref) if builtin_name(ref) is None else None
    return published is not None and is_vision_language_config(published)


def is_vision_language_config(cfg: dict) -> bool:
    """Whether Hugging Face ``cfg`` is of a vision-language model the trainer builds."""
    return (cfg.get("architectures") or [""])[0] in VISION_LANGUAGE_ARCHITECTURES
