"""Qwen2.5-VL's shape, and its Hugging Face <-> trainer parameter conversion.

The trainer's Qwen2.5-VL (``trainer/vlm_model.py``) is a Megatron-core GPT with multimodal RoPE
for the language model (under ``language.``) and transformers' own vision tower and patch
merger, replicated on every rank (under ``vision.``). The language model's tensors are a Qwen2
decoder's, converted by ``hf_conversion`` (TP-sharded like the text families); the vision
tower's are copied as they are.

Checkpoints name the parts ``model.*`` and ``visual.*`` (the form the hub's checkpoints and
SGLang use, and what transformers writes) or ``model.language_model.*`` and ``model.visual.*``
(transformers' in-memory names); both are read, the first is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relax_launch.models.registry import VISION_LANGUAGE_ARCHITECTURES
from relax_launch.trainer.hf_conversion import (
    check_checkpoint,
    hf_to_megatron,
    megatron_to_hf,
    tp_split_dim,
)
from relax_launch.trainer.model_shape import ModelShape

LANGUAGE, VISION = "language.", "vision."  # the trainer module's two parts
HF_VISION = "visual."
# transformers' in-memory names -> the checkpoint's
_HF_ALIASES = (("model.language_model.", "model."), ("model.visual.", HF_VISION))


@dataclass(frozen=True)
class VLShape:
    """A Qwen2.5-VL: its language model's shape, the vision tower's config (transformers'
    fields) and the facts tying them: the image placeholder token, how many patches merge into
    one token, and the multimodal RoPE's split of the rotary frequencies (temporal, height,
    width)."""

    text: ModelShape
    vision: dict[str, Any]
    image_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> VLShape:
        architecture = (cfg.get("architectures") or ["(none)"])[0]
        if architecture not in VISION_LANGUAGE_ARCHITECTURES:
            raise ValueError(f"architecture {architecture} is not a vision-language model")
        text = dict(cfg.get("text_config") or cfg)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        section = rope.pop("mrope_section", None)
        if not section or 2 * sum(section) != text["hidden_size"] // text["num_attention_heads"]:
            raise ValueError(f"mrope_section {section} does not cover the rotary dimension")
        rope.pop("type", None)
        rope["rope_type"] = "default"  # mrope's frequencies are the default RoPE's
        text |= {
            "architectures": ["Qwen2ForCausalLM"],  # the decoder is Qwen2's
            "rope_parameters": rope,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        }
        text.pop("rope_scaling", None)
        return cls(
            text=ModelShape.from_hf_config(text),
            vision=dict(cfg["vision_config"]),
            image_token_id=cfg["image_token_id"],
            spatial_merge_size=cfg["vision_config"].get("spatial_merge_size", 2),
            mrope_section=tuple(section),
        )


def checkpoint_names(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` under the checkpoint's names (``model.*``, ``visual.*``, ``lm_head.*``)."""
    out = {}
    for name, tensor in hf.items():
        for alias, canonical in _HF_ALIASES:
            if name.startswith(alias):
                name = canonical + name[len(alias) :]
                break
        out[name] = tensor
    return out


def split_parts(
    hf: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(language tensors, vision tensors under the tower's own names) of a checkpoint."""
    hf = checkpoint_names(hf)
    vision = {k[len(HF_VISION) :]: v for k, v in hf.items() if k.startswith(HF_VISION)}
    language = {k: v for k, v in hf.items() if not k.startswith(HF_VISION)}
    return language, vision


def check_vlm_checkpoint(
    hf: dict[str, torch.Tensor], shape: VLShape, vision_names: set[str]
) -> None:
    """Refuse a checkpoint whose language part is not exactly the shape's, or whose vision
    part is not exactly the tower's ``vision_names``."""
    language, vision = split_parts(hf)
    check_checkpoint(language, shape.text)
    unread, missing = set(vision) - vision_names, vision_names - set(vision)
    if unread or missing:
        raise ValueError(
            f"the vision tower's tensors do not match its config: unread {sorted(unread)[:6]}, "
            f"missing {sorted(missing)[:6]}"
        )


def vlm_hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: VLShape, *, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """The trainer module's state dict on TP rank ``tp_rank``: the language model's shard, the
    whole vision tower."""
    language, vision = split_parts(hf)
    shard = hf_to_megatron(language, shape.text, tp_rank=tp_rank, tp_size=tp_size)
    out = {LANGUAGE + name: tensor for name, tensor in shard.items()}
    out |= {VISION + name: tensor for name, tensor in vision.items()}
    return out


def vlm_tp_split_dim(name: str) -> int | None:
    """The dimension a trainer parameter is sharded along over TP (None: replicated)."""
    if name.startswith(VISION):
        return None
    return tp_split_dim(name[len(LANGUAGE) :])


def vlm_megatron_to_hf(
    name: str, full: torch.Tensor, shape: VLShape, *, tp_size: int, fused: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one TP-gathered trainer parameter (``megatron_to_hf``'s
    contract; the vision tower's pass through under ``visual.``)."""
    if name.startswith(VISION):
        yield HF_VISION + name[len(VISION) :], full
        return
    yield from megatron_to_hf(
        name[len(LANGUAGE) :], full, shape.text, tp_size=tp_size, layer_offset=0, fused=fused
    )
