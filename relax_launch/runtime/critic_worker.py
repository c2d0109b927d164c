"""The value model's commands (PPO's critic on the trainer's ranks): the records rank 0 sends,
the worker that answers them on each trainer rank, and rank 0's typed client. Batches go
beside the commands over the ``ShardChannel``, as the trainer's do; per-token values come back
from each DP rank's tp0 rank the way logprobs do.

In a colocated placement the value model lives in host memory between the trainer's turns: it
is offloaded once built, and rank 0 moves its parts in and out within the turn
(``runtime/critic_turns.py``, the same ``StateOffloader`` as the policy's). A checkpoint's save
or load brings the parts it needs back for its own duration."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from relax_launch.models.build import ensure_model
from relax_launch.runtime.control import Command, Handler
from relax_launch.runtime.distributed import ShardChannel
from relax_launch.runtime.trainer_client import TrainerClient, moved_by_ranks
from relax_launch.trainer.batch import ShardShape, TokenBatch
from relax_launch.trainer.critic import Critic
from relax_launch.trainer.offload import PARTS, StateOffloader

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig


@dataclass(frozen=True)
class CriticValues(Command):
    """Per-token values of the batch whose DP shards have these shapes (sent alongside)."""

    op: ClassVar[str] = "critic.values"
    shapes: tuple[ShardShape, ...]


@dataclass(frozen=True)
class CriticTrainStep(Command):
    """One optimizer step of the clipped value loss (returns and old values in the batch)."""

    op: ClassVar[str] = "critic.train_step"
    shapes: tuple[ShardShape, ...]
    value_clip: float | None


@dataclass(frozen=True)
class SaveCritic(Command):
    op: ClassVar[str] = "critic.save"
    directory: str


@dataclass(frozen=True)
class LoadCritic(Command):
    op: ClassVar[str] = "critic.load"
    directory: str


@dataclass(frozen=True)
class OffloadCritic(Command):
    """Move these parts of the value model's state ("params", "grads", "optimizer") to host
    memory (``trainer/offload.py``)."""

    op: ClassVar[str] = "critic.offload"
    parts: tuple[str, ...]


@dataclass(frozen=True)
class OnloadCritic(Command):
    op: ClassVar[str] = "critic.onload"
    parts: tuple[str, ...]


class CriticWorker:
    """This trainer rank's share of the value model (``trainer/critic.py``); ``colocated``: it
    goes to host memory once built, the engines being about to take the device."""

    def __init__(self, *, critic: Any, shards: ShardChannel, colocated: bool = False) -> None:
        self.critic, self.shards = critic, shards
        self.offloader = StateOffloader(critic.model, critic.optimizer)
        if colocated:
            self.offloader.offload(PARTS)

    def handlers(self) -> dict[str, Handler]:
        return {
            CriticValues.op: self.values,
            CriticTrainStep.op: self.train_step,
            SaveCritic.op: self.save,
            LoadCritic.op: self.load,
            OffloadCritic.op: lambda c: self.move("offload", c.parts),
            OnloadCritic.op: lambda c: self.move("onload", c.parts),
        }

    def values(self, command: CriticValues) -> None:
        """This shard's per-token values go to rank 0 over the shard channel."""
        shape = command.shapes[self.shards.dp_rank]
        shard = self.shards.receive(shape)
        rows = None
        try:
            self.offloader.require("critic.values", ("params",))
            rows = self.critic.values(shard)
        finally:  # rank 0 waits for them whatever happened
            self.shards.send_result(rows, shape)

    def train_step(self, command: CriticTrainStep) -> dict[str, float]:
        shard = self.shards.receive(command.shapes[self.shards.dp_rank])
        self.offloader.require("critic.train_step", PARTS)
        return self.critic.train_step(shard, command.value_clip)

    def move(self, action: str, parts: Iterable[str]) -> dict[str, float]:
        """Offload or onload ``parts``: the bytes moved and the seconds it took."""
        start = time.perf_counter()
        moved = getattr(self.offloader, action)(parts)
        return {"bytes": sum(moved.values()), "seconds": time.perf_counter() - start}

    def save(self, command: SaveCritic) -> str | None:
        with self._resident(("params", "optimizer")):
            return self.critic.save(Path(command.directory))

    def load(self, command: LoadCritic) -> int:
        with self._resident(("params", "optimizer")):
            return self.critic.load(Path(command.directory))

    @contextmanager
    def _resident(self, parts: tuple[str, ...]) -> Iterator[None]:
        """``parts`` on the device for the duration; those that were offloaded go back after."""
        away = tuple(p for p in parts if not self.offloader.resident(p))
        self.offloader.onload(away)
        try:
            yield
        finally:
            self.offloader.offload(away)

    def close(self) -> None:
        pass


class CriticClient(TrainerClient):
    """Rank 0's typed proxy for the value model on the trainer ranks."""

    def values(self, batch: TokenBatch) -> list[list[float]]:
        """Per-token values of ``tokens[:-1]`` positions of every sequence, in batch order."""
        shards = batch.shards(self.layout.dp_size)
        return self._per_token(CriticValues(tuple(s.shape() for s in shards)), shards)

    def train(self, batch: TokenBatch, value_clip: float | None) -> dict[str, float]:
        """One value-model step; the metrics of the first trainer rank (every rank reports the
        batch's, reduced over data-parallel ranks)."""
        shards = batch.shards(self.layout.dp_size)
        command = CriticTrainStep(tuple(s.shape() for s in shards), value_clip)
        return self._with_shards(command, shards)[0][self._last_stage_rank()]

    def save(self, directory: str) -> list[str]:
        return [path for path in self._call(SaveCritic(directory)).values() if path]

    def load(self, directory: str) -> int:
        return min(self._call(LoadCritic(directory)).values())

    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Every trainer rank moves these parts of its value model to host memory; the bytes
        moved (summed over ranks) and the slowest rank's seconds."""
        return moved_by_ranks(self._call(OffloadCritic(tuple(parts))))

    def onload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        return moved_by_ranks(self._call(OnloadCritic(tuple(parts))))


def build_critic_worker(job: JobConfig, pgc: Any, shards: ShardChannel) -> CriticWorker:
    """This trainer rank's share of the value model, built from ``critic.model`` (default the
    policy's) with the trainer's layout (``CriticConfig.trainer_section``)."""
    section = job.critic.trainer_section(job.trainer)
    critic = Critic(
        section=section, model_dir=ensure_model(section.model), pgc=pgc, device=job.cluster.device
    )
    return CriticWorker(critic=critic, shards=shards, colocated=job.placement.mode != "decoupled")
