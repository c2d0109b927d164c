"""The ``critic:`` section: PPO's learned value model (the rules that tie it to the rest of a
job are ``config/critic_rules.py``'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from relax_launch.config.section import Section

if TYPE_CHECKING:
    from relax_launch.trainer.config import TrainerConfig


class CriticConfig(Section):
    """PPO's value model: the Megatron GPT body of ``model`` with a scalar value head, trained
    on the trainer's ranks after the policy each step (``trainer/critic.py``); in a colocated
    placement offloaded between the trainer's turns (``runtime/critic_turns.py``). With
    ``ranks: own`` (decoupled) it has ranks of its own and trains beside the policy."""

    model: str | None = Field(
        None,
        description="Hugging Face model (id or path) whose body the value model starts from; its "
        "language-model head is replaced by a new Linear(hidden, 1) value head (weights drawn "
        "from N(0, 1/(hidden+1)^2) with trainer.seed, bias 0). Unset: trainer.model.",
    )
    lr: float = Field(1e-5, gt=0, description="The value model's Adam learning rate.")
    value_clip: float | None = Field(
        0.2,
        gt=0,
        description="PPO's value clip: the loss is 0.5 max((V - R)^2, (clip(V, V_old - "
        "value_clip, V_old + value_clip) - R)^2) per token; null: 0.5 (V - R)^2. V_old is "
        "the values before the step's first update, so the clip binds from the second of "
        "mini_batches on (with one update per step V = V_old and it never does).",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="The value model's optimizer steps per RL step, each on a contiguous "
        "1/mini_batches of the batch (every sample once).",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="The first warmup_steps RL steps train the value model alone: the policy's "
        "step is skipped (its weights, and so the rollouts, stay as they were), so the critic "
        "learns the returns of a fixed policy before its advantages steer one (verl's "
        "critic_warmup). Must be below algorithm.num_steps. 0: the policy trains from the "
        "first step.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per micro-batch per DP rank for the value model's forward and "
        "backward; unset: the trainer's micro-batching.",
    )
    ranks: Literal["trainer", "own"] = Field(
        "trainer",
        description="trainer: the value model shares the trainer's ranks, trained after the "
        "policy each step. own (placement.mode=decoupled): it has ranks of its own, "
        "tp_size x dp_size of them, placed after the trainer's, and trains while the policy "
        "does (relax-launch plan shows them).",
    )
    dp_size: int | None = Field(
        None,
        ge=1,
        description="With ranks=own: the value model's data-parallel size (its ranks are "
        "tp_size x dp_size); unset: 1. With ranks=trainer it is the trainer's: leave it unset.",
    )
    offload: Literal["auto", "swap", "keep"] = Field(
        "auto",
        description="Colocated placement (split, defer), where the value model is on the "
        "device only in the trainer's turn (in host memory while the engines hold it). Within "
        "that turn, swap: its parameters, gradients and optimizer state stay in host memory "
        "while the policy trains, and the policy's gradients and optimizer state go there while "
        "it trains; keep: both models stay on the device through the turn; auto: swap when the "
        "memory plan's train phases do not hold both (relax-launch plan shows which). "
        "Decoupled placement keeps both resident: leave it auto.",
    )
    tp_size: int | None = Field(
        None,
        ge=1,
        description="The value model's tensor-parallel size: with ranks=trainer it must equal "
        "trainer.tp_size (it shares the ranks); with ranks=own its own. Unset: trainer.tp_size.",
    )
    pp_size: int | None = Field(
        None,
        ge=1,
        description="Must equal trainer.pp_size (ranks=trainer), 1 with ranks=own (the value "
        "model is one pipeline stage); unset: that.",
    )

    @property
    def own_ranks(self) -> bool:
        return self.ranks == "own"

    def own_layout(self, trainer: TrainerConfig) -> tuple[int, int]:
        """(tp_size, dp_size) of the value model on ranks of its own."""
        return self.tp_size or trainer.tp_size, self.dp_size or 1

    def trainer_section(self, trainer: TrainerConfig) -> TrainerConfig:
        """The trainer section the value model is built with: the trainer's layout, dtype and
        seed, this section's model, learning rate and micro-batches; every weight trained (no
        LoRA) with a plain optimizer (each DP rank holds the whole Adam state)."""
        update: dict = {
            "model": self.model or trainer.model,
            "lr": self.lr,
            "lora": None,
            "distributed_optimizer": False,
            "optimizer_offload": False,
        }
        if self.own_ranks:  # its own grid: TP x DP, one stage, none of the policy's PP/CP/EP
            tp, dp = self.own_layout(trainer)
            update |= {"tp_size": tp, "ranks": tp * dp, "pp_size": 1, "cp_size": 1, "ep_size": 1}
        if self.micro_batch_size is not None:
            update |= {
                "micro_batch_size": self.micro_batch_size,
                "max_tokens_per_micro_batch": None,
            }
        return trainer.model_copy(update=update)
