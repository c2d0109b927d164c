"""The value model's commands (PPO's critic on the trainer's ranks, or on ranks of its own): the
records rank 0 sends, the worker that answers them on each of its ranks, and rank 0's typed
client. Batches go beside the commands over a ``ShardChannel`` (the trainer's, or one over the
critic's own grid), as the trainer's do; per-token values come back from each DP rank's tp0
rank the way logprobs do. On ranks of its own, rank 0 posts the critic's steps and goes on to
the policy's: both train at once (``start_training``, ``finish_training``).

In a colocated placement the value model lives in host memory between the trainer's turns: it
is offloaded once built, and rank 0 moves its parts in and out within the turn
(``runtime/critic_turns.py``, the same ``StateOffloader`` as the policy's). A checkpoint's save
or load brings the parts it needs back for its own duration."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from relax_launch.models.build import ensure_model
from relax_launch.runtime.control import Command, Handler, Posted
from relax_launch.runtime.distributed import CONTROLLER, ShardChannel, Transfer
from relax_launch.runtime.trainer_client import TrainerClient, moved_by_ranks
from relax_launch.trainer.batch import ShardShape, TokenBatch
from relax_launch.trainer.critic import STEP_SECONDS, Critic
from relax_launch.trainer.offload import PARTS, StateOffloader

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

log = logging.getLogger(__name__)


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
    """This rank's share of the value model (``trainer/critic.py``); ``colocated``: it
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
        """One step's metrics, with how long it took on this rank (``STEP_SECONDS``: a
        duration, which rank 0 sets beside the policy's on ranks of its own); logged by the
        rank whose reply rank 0 reads (tp 0, dp 0), not by each of the critic's ranks."""
        started = time.monotonic()
        shard = self.shards.receive(command.shapes[self.shards.dp_rank])
        self.offloader.require("critic.train_step", PARTS)
        metrics = self.critic.train_step(shard, command.value_clip)
        if self.shards.rank == self.shards.result_rank(0):  # the one whose reply rank 0 reads
            log.info(
                "critic step %d: value loss %.6g, clip fraction %.3g, grad norm %.4g",
                self.critic.step,
                metrics["critic/value_loss"],
                metrics["critic/clip_fraction"],
                metrics["critic/grad_norm"],
            )
        return metrics | {STEP_SECONDS: time.monotonic() - started}

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
    """Rank 0's typed proxy for the value model, on the trainer's ranks or its own."""

    def values(self, batch: TokenBatch) -> list[list[float]]:
        """Per-token values of ``tokens[:-1]`` positions of every sequence, in batch order."""
        shards = batch.shards(self.layout.dp_size)
        return self._per_token(CriticValues(tuple(s.shape() for s in shards)), shards)

    def train(self, batch: TokenBatch, value_clip: float | None) -> dict[str, float]:
        """One value-model step; the metrics of the first trainer rank (every rank reports the
        batch's, reduced over data-parallel ranks)."""
        return self.finish_training(self.start_training([batch], value_clip))[0]

    def start_training(
        self, batches: list[TokenBatch], value_clip: float | None
    ) -> list[tuple[Posted, Transfer]]:
        """Post one value-model step per batch, in order, and send their shards; the ranks
        train them while rank 0 goes on (``finish_training`` collects them). Several at once
        only on ranks of its own: rank 0 holds one shard of its own at a time."""
        if len(batches) > 1 and CONTROLLER in self.layout.ranks:
            raise ValueError("several critic steps in flight need the critic's own ranks")
        started = []
        for batch in batches:
            shards = batch.shards(self.layout.dp_size)
            command = CriticTrainStep(tuple(s.shape() for s in shards), value_clip)
            posted = self.channel.post(command, self.layout.ranks)
            started.append((posted, self.shards.start(shards)))
        return started

    def finish_training(self, started: list[tuple[Posted, Transfer]]) -> list[dict[str, float]]:
        """Each started step's metrics (with ``STEP_SECONDS``), in order."""
        steps = []
        for done, (posted, transfer) in enumerate(started):
            try:
                steps.append(self._collect(posted, transfer)[self._last_stage_rank()])
            except BaseException:  # the later steps' sends are finished too: none left pending
                for later in started[done + 1 :]:
                    with contextlib.suppress(Exception):
                        self._collect(*later)
                raise
        return steps

    def _collect(self, posted: Posted, transfer: Transfer) -> dict[int, Any]:
        replies = self.channel.collect(posted, self.local.get(posted.command.route))
        self.shards.finish(transfer)
        return replies

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
    """This rank's share of the value model, built from ``critic.model`` (default the
    policy's) with the trainer's layout, or its own on ranks of its own
    (``CriticConfig.trainer_section``)."""
    section = job.critic.trainer_section(job.trainer)
    critic = Critic(
        section=section,
        model_dir=ensure_model(section.model),
        pgc=pgc,
        device=job.cluster.device,
        tp_field="critic.tp_size" if job.critic.own_ranks else "trainer.tp_size",
    )
    return CriticWorker(critic=critic, shards=shards, colocated=job.placement.mode != "decoupled")
