"""Config section owned by the trainer (Megatron-core)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax_launch.config.section import Section


class TrainerConfig(Section):
    """The policy being trained, and how it is parallelised over the trainer ranks."""

    model: str = Field(
        description="Policy model: a Hugging Face model directory (Llama, Qwen2 or Qwen3 "
        "family), or builtin:NAME (smollm2-135m-instruct, tiny-llama, tiny-qwen2, tiny-qwen3)."
    )
    ranks: int | None = Field(
        None,
        description="Trainer ranks. Required in 'decoupled'; in 'split' and 'defer' the trainer "
        "always spans every rank, so leave it unset.",
    )
    tp_size: int = Field(1, ge=1, description="Megatron tensor-parallel size.")
    pp_size: int = Field(1, ge=1, description="Megatron pipeline-parallel size.")
    micro_batch_size: int = Field(1, ge=1, description="Sequences per micro-batch per DP rank.")
    lr: float = Field(1e-6, gt=0, description="Adam learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Adam weight decay.")
    clip_grad: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 turns clipping off.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Parameter and compute dtype."
    )
    seed: int = Field(1234, description="Seed of initialisation and dropout.")
