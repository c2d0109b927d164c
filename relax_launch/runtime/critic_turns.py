"""The value model's memory within the trainer's turn of a colocated step (split, defer).

The critic shares the trainer's ranks, and the engines take them between the trainer's turns:
its state lives in host memory from its build on (``CriticWorker``), and comes to the device
only inside the trainer's turn, which the ``LifecycleCoordinator`` grants the trainer alone
(the critic is a part of the trainer's lease, not a role of its own). How it comes is the
memory plan's choice (``placement/critic_memory.py``, ``critic.offload``):

- ``keep``: the whole critic onloads for scoring and stays through both train steps;
- ``swap``: its parameters onload for scoring and leave again; the policy trains without it;
  then the policy's gradients and optimizer state go to host memory while the critic trains
  (the policy's parameters stay: the next sync sends them);
- ``resident`` (decoupled): nothing moves.

Each turn ends as it began (``done``): the critic in host memory, the policy whole on the
device, as the coordinator's lease says; ``done`` runs also after a failure. A checkpoint's
save or load of the critic moves memory as its step does (``checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from relax_launch.placement.critic_memory import CriticMode, wanted_mode
from relax_launch.placement.memory_plan import memory_plan
from relax_launch.runtime.critic_worker import CriticClient
from relax_launch.runtime.trainer_client import TrainerClient
from relax_launch.trainer.offload import CHANGED, PARTS

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.placement.plan import PlacementPlan

OPTIMIZER_STATE = ("grads", "optimizer")
T = TypeVar("T")


def critic_mode(job: JobConfig, plan: PlacementPlan) -> CriticMode | None:
    """How the value model's memory moves (None: no critic): ``critic.offload``, its ``auto``
    resolved by the memory plan (``swap`` where a model's size is unknown: the plan cannot
    tell, and swapping always fits what keeping does)."""
    wanted = wanted_mode(job, plan)
    if wanted != "auto":
        return wanted
    memory = memory_plan(job, plan)
    return memory.critic_mode if memory is not None else "swap"


class CriticTurns:
    """Rank 0's moves of the critic's (and, swapping, the policy's) state within a step; the
    bytes moved each way, summed, for the step's ``memory/*`` metrics."""

    def __init__(self, trainer: TrainerClient, critic: CriticClient, mode: CriticMode) -> None:
        self.trainer, self.critic, self.mode = trainer, critic, mode
        self.moved: dict[str, float] = {}

    def scoring(self) -> None:
        """Before the critic scores the batch (V_old)."""
        if self.mode != "resident":
            parts = PARTS if self.mode == "keep" else ("params",)
            self._count("critic_onloaded", self.critic.onload(parts))

    def policy_training(self) -> None:
        """Before the policy's step."""
        if self.mode == "swap":
            self._count("critic_offloaded", self.critic.offload(("params",)))

    def critic_training(self) -> None:
        """Before the critic's step(s)."""
        if self.mode == "swap":
            self._count("policy_swapped_out", self.trainer.offload(OPTIMIZER_STATE))
            self._count("critic_onloaded", self.critic.onload(PARTS))

    def done(self) -> None:
        """The end of the turn, whatever happened in it: the critic back in host memory, the
        policy's state on the device."""
        if self.mode == "resident":
            return
        self._count("critic_offloaded", self.critic.offload(PARTS))
        if self.mode == "swap":
            self._count("policy_swapped_in", self.trainer.onload(OPTIMIZER_STATE))

    def checkpoint(self, critic_part: Callable[[], T]) -> T:
        """The critic's save or load (``critic_part``), between steps or before the first, where
        the policy is whole on the device and the critic in host memory: the critic's worker
        brings its parameters and optimizer state for the duration, and swapping, the policy's
        gradients and optimizer state leave first, as for the critic's step (the plan's ``train
        critic`` phase holds that moment; both models' state at once it does not). Kept, the
        plan's ``train critic`` holds both. Only the parts that offload moved come back: one
        already in host memory stays there."""
        if self.mode != "swap":
            return critic_part()
        reply = self.trainer.offload(OPTIMIZER_STATE)
        moved = tuple(p for p in OPTIMIZER_STATE if reply.get(f"{CHANGED}{p}"))
        try:
            return critic_part()
        finally:
            if moved:
                self.trainer.onload(moved)

    def take_moved(self) -> dict[str, float]:
        """The bytes moved since the last call, by direction."""
        moved, self.moved = self.moved, {}
        return moved

    def _count(self, key: str, reply: dict[str, float]) -> None:
        self.moved[key] = self.moved.get(key, 0.0) + reply.get("bytes", 0.0)
