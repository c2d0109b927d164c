"""Which module the trainer's policy is: a Megatron-core GPT (the text families) or a Qwen2.5-VL
(``trainer/vlm_policy.py``), chosen by the HF checkpoint's architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_launch.models.registry import is_vision_language
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.model import build_gpt, build_gpt_module, load_hf_checkpoint, read_shape
from relax_launch.trainer.model_shape import ModelShape
from relax_launch.trainer.vlm_conversion import VLShape
from relax_launch.trainer.vlm_model import build_vlm_module
from relax_launch.trainer.vlm_policy import build_vlm_policy


def build_policy(
    section: TrainerConfig, pgc: Any, device: str, model_dir: Path
) -> tuple[Any, ModelShape, VLShape | None]:
    """The DDP-wrapped policy loaded from ``model_dir``, its (language model's) shape, and a
    vision-language model's VLShape (None for a text model)."""
    if is_vision_language(str(model_dir)):
        model, vision = build_vlm_policy(section, pgc, device, model_dir)
        return model, vision.text, vision
    shape = read_shape(model_dir)
    model = build_gpt(shape, section, pgc, device, model_dir)
    load_hf_checkpoint(model.module, model_dir, shape, pgc)
    return model, shape, None


def bare_module(
    shape: ModelShape | VLShape, section: TrainerConfig, pgc: Any, device: str, model_dir: Path
) -> Any:
    """The policy's module without DDP, its weights not loaded (the reference model's)."""
    if isinstance(shape, VLShape):
        return build_vlm_module(shape, section, pgc, device)
    return build_gpt_module(shape, section, pgc, device, model_dir)
