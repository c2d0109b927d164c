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
    placement offloaded between the trainer's turns (``runtime/critic_turns.py``)."""

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
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per micro-batch per DP rank for the value model's forward and "
        "backward; unset: the trainer's micro-batching.",
    )
    ranks: Literal["trainer", "own"] = Field(
        "trainer",
        description="trainer: the value model shares the trainer's ranks, trained after the "
        "policy each step. own (ranks of its own) is not built yet and is refused.",
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
        None, ge=1, description="Must equal trainer.tp_size (it shares the ranks); unset: it."
    )
    pp_size: int | None = Field(
        None, ge=1, description="Must equal trainer.pp_size (it shares the ranks); unset: it."
    )

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
        if self.micro_batch_size is not None:
            update |= {
                "micro_batch_size": self.micro_batch_size,
                "max_tokens_per_micro_batch": None,
            }
        return trainer.model_copy(update=update)
