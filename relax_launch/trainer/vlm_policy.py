"""The trainer's policy when it is a vision-language model (Qwen2.5-VL, ``trainer/vlm_model.py``):
built and loaded from the HF checkpoint, under Megatron's DDP like the text families, and
exported under the checkpoint's HF names (``model.*`` for the language model, ``visual.*`` for
the tower), which SGLang's Qwen2.5-VL loader and transformers read.

With ``trainer.freeze_vision`` the tower (patch embedding, blocks, merger) takes no gradient:
the optimizer holds only the language model, and a sync that sends only what training changes
(decoupled engines) leaves the tower out. With ``trainer.lora`` the adapters on the language
model's targeted linears are all that trains (``trainer/lora.py``, as for the text families):
the tower is frozen too, and a sync sends the targeted weights merged, the tower never.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_export import HFExport
from relax_launch.trainer.lora import apply_lora
from relax_launch.trainer.model import wrap_ddp
from relax_launch.trainer.recompute import inputs_need_grad
from relax_launch.trainer.vlm_conversion import (
    VISION,
    VLShape,
    vlm_megatron_to_hf,
    vlm_tp_split_dim,
)
from relax_launch.trainer.vlm_model import build_vlm_module, load_vlm_checkpoint, read_vl_shape


def build_vlm_policy(
    section: TrainerConfig, pgc: Any, device: str, model_dir: Path
) -> tuple[Any, VLShape]:
    """The DDP-wrapped trainer Qwen2.5-VL of ``model_dir``, loaded, and its shape."""
    shape = read_vl_shape(model_dir)
    module = build_vlm_module(shape, section, pgc, device)
    load_vlm_checkpoint(module, model_dir, pgc)
    # before DDP, which buckets only the trainable parameters
    if section.freeze_vision or section.lora is not None:
        module.vision.requires_grad_(False)
    if section.lora is not None:  # the language model is one stage: its layers start at 0
        apply_lora(module.language, section.lora, pgc.tp, 0, section.seed)
        if section.recompute == "full":  # the embedding is frozen (see inputs_need_grad)
            inputs_need_grad(module.language)
    return wrap_ddp(module, section, pgc), shape


class VLMExport(HFExport):
    """``HFExport`` of the trainer's Qwen2.5-VL: the language model TP-gathered and converted
    like a Qwen2 decoder's, the replicated tower as it is, under ``visual.``."""

    def __init__(self, module: Any, shape: VLShape, pgc: Any, lora: dict[str, Any]) -> None:
        super().__init__(module, shape.text, pgc, lora)
        self.vl_shape = shape

    def split_dim(self, name: str) -> int | None:
        return vlm_tp_split_dim(name)

    def to_hf(
        self, name: str, full: torch.Tensor, fused: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return vlm_megatron_to_hf(
            name, full, self.vl_shape, tp_size=self.pgc.tp.size(), fused=fused
        )

    def _params(self, changed_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight; with ``changed_only``, not a frozen tower's."""
        for name, param in super()._params(changed_only):
            if changed_only and name.startswith(VISION) and not param.requires_grad:
                continue
            yield name, param
