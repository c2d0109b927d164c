"""Config section owned by the trainer (Megatron-core)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relax_launch.config.section import Section

LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
# Hugging Face projections -> the trainer's fused linear that holds them
HF_PROJECTIONS = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}


class LoraConfig(Section):
    """Low-rank adapters: the base weights stay frozen, each targeted linear learns W + scale·BA
    (scale = alpha / rank)."""

    rank: int = Field(ge=1, description="Adapter rank r.")
    alpha: float | None = Field(
        None, gt=0, description="Scale numerator: the update is (alpha / rank)·BA. Unset: rank."
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input while training."
    )
    engines: Literal["merged", "adapter"] = Field(
        "merged",
        description="How the rollout engines hold the policy. 'merged': the base weights with "
        "the adapters merged in, each sync sending the targeted weights (W + scale·BA), in place "
        "(in split/defer the whole model: a released engine's weights come back as zeros). "
        "'adapter': SGLang's LoRA serving, the base model plus each version's adapter loaded "
        "from the run directory (decoupled placement and text models only).",
    )
    target_modules: tuple[LoraTarget, ...] = Field(
        ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
        min_length=1,
        description="The trainer's linears that get an adapter: linear_qkv (q/k/v), linear_proj "
        "(o_proj), linear_fc1 (gate/up), linear_fc2 (down_proj).",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _known_targets(cls, value: object) -> object:
        for name in value if isinstance(value, list | tuple) else ():
            if name in HF_PROJECTIONS:
                raise ValueError(
                    f"'{name}' is fused into the trainer's {HF_PROJECTIONS[name]}: target "
                    f"{HF_PROJECTIONS[name]} (its adapter is exported as {name}'s)"
                )
        return value

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank

    @property
    def hf_target_modules(self) -> list[str]:
        """The Hugging Face projections the targeted linears hold (PEFT's and SGLang's names)."""
        return [hf for hf, ours in HF_PROJECTIONS.items() if ours in self.target_modules]


class TrainerConfig(Section):
    """The policy being trained, and how it is parallelised over the trainer ranks."""

    model: str = Field(
        description="Policy model: a Hugging Face model directory (Llama, Qwen2, Qwen3, "
        "Qwen3-MoE or Qwen2-MoE family), or builtin:NAME (smollm2-135m-instruct, tiny-llama, "
        "tiny-qwen2, tiny-qwen3, tiny-qwen3-moe, tiny-qwen2-moe)."
    )
    ranks: int | None = Field(
        None,
        description="Trainer ranks. Required in 'decoupled'; in 'split' and 'defer' the trainer "
        "always spans every rank, so leave it unset.",
    )
    tp_size: int = Field(1, ge=1, description="Megatron tensor-parallel size.")
    pp_size: int = Field(1, ge=1, description="Megatron pipeline-parallel size.")
    ep_size: int = Field(
        1,
        ge=1,
        description="Expert-parallel size of a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE): "
        "each MoE layer's experts are split over this many data-parallel ranks; it must divide "
        "the data-parallel size and the experts. Experts keep trainer.tp_size as their tensor "
        "parallelism (with sequence parallelism on, as Megatron's MoE layer needs). 1 for a "
        "dense model.",
    )
    cp_size: int = Field(
        1,
        ge=1,
        description="Context-parallel size: each sequence is split over this many ranks (a "
        "contiguous slice each; every attention layer gathers the keys and values of all of "
        "them), for sequences longer than one rank should hold. Not with ep_size > 1.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per micro-batch per DP rank (must divide a DP rank's share of "
        "the step); unset: 1. Not with max_tokens_per_micro_batch, which sizes micro-batches "
        "instead.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Token budget per micro-batch: a DP rank's sequences are grouped by length "
        "so that each micro-batch computes at most this many tokens (padding included; packed, "
        "the row's tokens), and the count per micro-batch varies. The loss is per token over the "
        "whole batch, so the gradient does not depend on the grouping. Unset: micro_batch_size "
        "sequences each.",
    )
    pack_sequences: bool = Field(
        False,
        description="Put each micro-batch's sequences end to end in one row, positions "
        "restarting at each, attention never crossing from one to another (each attends "
        "within itself), so no padding is computed between them. Best with "
        "max_tokens_per_micro_batch.",
    )
    lr: float = Field(1e-6, gt=0, description="Adam learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Adam weight decay.")
    clip_grad: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 turns clipping off.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Parameter and compute dtype."
    )
    seed: int = Field(1234, description="Seed of initialisation and dropout.")
    distributed_optimizer: bool = Field(
        False,
        description="Megatron-core's distributed optimizer: the fp32 master weights and Adam's "
        "state are sharded over the data-parallel (x context-parallel) ranks, gradients "
        "reduce-scattered and parameters all-gathered, so each rank holds 1/DP of them "
        "(relax-launch plan shows the memory per device). Each DP rank checkpoints its own "
        "shard: a checkpoint resumes only with the same setting and data-parallel size.",
    )
    optimizer_offload: bool = Field(
        False,
        description="Megatron-core's optimizer CPU offload: master weights and Adam's state live "
        "in host memory and the optimizer step runs on the CPU, freeing their device memory at "
        "the cost of a slower step. Needs distributed_optimizer, and cluster.device=cuda (on "
        "the CPU they are in host memory already).",
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="Activation recomputation (Megatron-core's): 'selective' recomputes each "
        "layer's core attention in the backward pass instead of keeping its tensors, 'full' "
        "keeps only each layer's input and recomputes the whole layer; less activation memory "
        "for more compute.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train low-rank adapters instead of every weight; lora.engines says how the "
        "rollout engines hold them.",
    )
    freeze_vision: bool = Field(
        False,
        description="A vision-language model (Qwen2.5-VL): keep its vision tower and patch "
        "merger as loaded, training the language model alone; the weight sync to decoupled "
        "engines then sends only the language model. trainer.lora implies it (LoRA keeps every "
        "base weight as loaded): leave it out or true there. Refused on a text model.",
    )

    @model_validator(mode="after")
    def _one_way_to_size_micro_batches(self) -> TrainerConfig:
        if self.max_tokens_per_micro_batch is not None and self.micro_batch_size is not None:
            raise ValueError(
                "trainer.micro_batch_size and trainer.max_tokens_per_micro_batch both size "
                "micro-batches: set one of them (trainer.micro_batch_size=null; the budget "
                "groups sequences by length)."
            )
        if self.cp_size > 1 and self.ep_size > 1:
            raise ValueError(
                "trainer.cp_size > 1 with trainer.ep_size > 1 is not supported yet (the experts' "
                "groups would span context-parallel ranks): use one of them."
            )
        return self

    @model_validator(mode="after")
    def _offload_inside_the_distributed_optimizer(self) -> TrainerConfig:
        if self.optimizer_offload and not self.distributed_optimizer:
            raise ValueError(
                "trainer.optimizer_offload needs trainer.distributed_optimizer=true (Megatron's "
                "offloaded optimizer runs inside its distributed optimizer): set "
                "trainer.distributed_optimizer=true, or trainer.optimizer_offload=false."
            )
        return self

    @property
    def sequences_per_micro_batch(self) -> int:
        """What a DP rank's share of a step must be a multiple of: the fixed micro-batches' size
        (1 when unset), or 1 under a token budget (which takes any count)."""
        return self.micro_batch_size or 1
