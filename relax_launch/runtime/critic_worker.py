"""The value model's commands (PPO's critic on the trainer's ranks, or on ranks of its own): the
records rank 0 sends, the worker that answers them on each of its ranks, and rank 0's typed
client. Batches go beside the commands over a ``ShardChannel`` (the trainer's, or one over the
critic's own grid), as the trainer's do; per-token values come back from each DP rank's tp0
rank the way logprobs do. On ranks of its own, rank 0 posts the critic's steps and goes on to
the policy's: both train at once (``start_training``, ``finish_training``). Every mini-batch's
shard of a DP rank travels in one transfer with the others (``CriticTrainSteps``), whatever
``critic.mini_batches``: rank 0 sends one DP rank's buffer (every mini-batch's rows joined) at a
time and none is left on its device once the sends are done, and a receiving critic rank holds
every mini-batch's joined tokens at once while it trains them in turn.

In a colocated placement the value model lives in host memory between the trainer's turns: it
is offloaded once built, and rank 0 moves its parts in and out within the turn
(``runtime/critic_turns.py``, the same ``StateOffloader`` as the policy's). A checkpoint's save
or load brings the parts it needs back for its own duration (swapping, with the policy's
optimizer state out first: ``CriticTurns.checkpoint``)."""

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
from relax_launch.runtime.distributed import ShardChannel, Transfer
from relax_launch.runtime.trainer_client import TrainerClient, moved_by_ranks
from relax_launch.trainer.batch import ShardShape, TokenBatch
from relax_launch.trainer.critic import STEP_SECONDS, STEP_TICKETS, Critic
from relax_launch.trainer.offload import PARTS, StateOffloader, move_parts

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CriticValues(Command):
    """Per-token values of the batch whose DP shards have these shapes (sent alongside)."""

    op: ClassVar[str] = "critic.values"
    shapes: tuple[ShardShape, ...]


@dataclass(frozen=True)
class CriticTrainSteps(Command):
    """``steps`` optimizer steps in order, on consecutive equal parts of each DP rank's shard
    (``shapes``: each DP rank's shards of every step, joined: ``joined_shards``)."""

    op: ClassVar[str] = "critic.train_steps"
    shapes: tuple[ShardShape, ...]
    steps: int
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


ORDER_KEY = "critic/order"  # the store's counter whose tickets order events across ranks


def order_ticket(store: Any) -> int:
    """The next ticket of the job's event counter: the store serves each add in turn, so the
    tickets order events of any ranks without their clocks."""
    return int(store.add(ORDER_KEY, 1))


class CriticWorker:
    """This rank's share of the value model (``trainer/critic.py``); ``colocated``: it
    goes to host memory once built, the engines being about to take the device. ``order``:
    on ranks of its own, the job's store, whose tickets bracket each step (``STEP_TICKETS``)."""

    def __init__(
        self, *, critic: Any, shards: ShardChannel, colocated: bool = False, order: Any = None
    ) -> None:
        self.critic, self.shards, self.order = critic, shards, order
        self.offloader = StateOffloader(critic.model, critic.optimizer)
        if colocated:
            self.offloader.offload(PARTS)

    def handlers(self) -> dict[str, Handler]:
        return {
            CriticValues.op: self.values,
            CriticTrainSteps.op: self.train_steps,
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

    def train_steps(self, command: CriticTrainSteps) -> list[dict[str, float]]:
        """Each step's metrics, in order, with how long it took on this rank
        (``STEP_SECONDS``: a duration, which rank 0 sets beside the policy's on ranks of its
        own; the first step's counts the shards' receive)."""
        started = time.monotonic()
        joined = self.shards.receive(command.shapes[self.shards.dp_rank])
        replies = []
        for shard in split_steps(joined, command.steps):
            replies.append(self._train(shard, command.value_clip, started))
            started = time.monotonic()
        return replies

    def _train(self, shard: TokenBatch, clip: float | None, started: float) -> dict[str, float]:
        """One optimizer step, logged by the rank whose reply rank 0 reads (tp 0, dp 0), not
        by each of the critic's ranks; that rank brackets it with tickets (with ``order``)."""
        self.offloader.require("critic.train_steps", PARTS)
        read = self.shards.rank == self.shards.result_rank(0)  # the one whose reply rank 0 reads
        tickets = read and self.order is not None
        began = order_ticket(self.order) if tickets else 0
        metrics = self.critic.train_step(shard, clip)
        if tickets:
            metrics |= dict(zip(STEP_TICKETS, (began, order_ticket(self.order)), strict=True))
        if read:
            log.info(
                "critic step %d: value loss %.6g, clip fraction %.3g, grad norm %.4g",
                self.critic.step,
                metrics["critic/value_loss"],
                metrics["critic/clip_fraction"],
                metrics["critic/grad_norm"],
            )
        return metrics | {STEP_SECONDS: time.monotonic() - started}

    def move(self, action: str, parts: Iterable[str]) -> dict[str, float]:
        """Offload or onload ``parts``: the bytes moved, the seconds it took, the parts moved."""
        return move_parts(self.offloader, action, parts)

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
    ) -> tuple[Posted, Transfer]:
        """Post one value-model step per batch, in order, and send their shards, each DP
        rank's joined into one (sent before this returns, ``ShardChannel.start``); the ranks
        train them while rank 0 goes on (``finish_training`` collects them)."""
        joined = joined_shards(batches, self.layout.dp_size)
        command = CriticTrainSteps(tuple(s.shape() for s in joined), len(batches), value_clip)
        posted = self.channel.post(command, self.layout.ranks)
        return posted, self._send_shards(posted, joined)

    def finish_training(self, started: tuple[Posted, Transfer]) -> list[dict[str, float]]:
        """Each started step's metrics (with ``STEP_SECONDS``), in order, waited for as long as
        one step's bound times the steps. A failed step still ends the transfer, then
        raises."""
        posted, transfer = started
        # one command runs every mini-batch's step: the bound is one step's, as many times
        timeout_s = self.channel.timeout_s * posted.command.steps
        try:
            replies = self.channel.collect(
                posted, self.local.get(posted.command.route), timeout_s=timeout_s
            )
        except BaseException:  # the transfer ends before the job's shutdown; the error wins
            with contextlib.suppress(Exception):
                self.shards.finish(transfer)
            raise
        self.shards.finish(transfer)
        return replies[self._last_stage_rank()]

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


def joined_shards(batches: list[TokenBatch], dp_size: int) -> list[TokenBatch]:
    """Per DP rank, its shard of every batch, in batch order, as one batch (what
    ``split_steps`` takes apart on that rank)."""
    per_batch = [batch.shards(dp_size) for batch in batches]
    return [TokenBatch.join([shards[dp] for shards in per_batch]) for dp in range(dp_size)]


def split_steps(joined: TokenBatch, steps: int) -> list[TokenBatch]:
    """``joined_shards``' batch of one DP rank back into its ``steps`` shards, in order (the
    batches of one post are the same size: ``critic.mini_batches`` equal parts); rows that do
    not divide into ``steps`` equal parts are refused, not dropped."""
    if steps < 1 or len(joined) % steps:
        raise ValueError(
            f"a critic rank's joined shard of {len(joined)} rows does not split into {steps} "
            "equal steps: the batches of one CriticTrainSteps must be the same size"
        )
    return joined.shards(steps)


def build_critic_worker(
    job: JobConfig, pgc: Any, shards: ShardChannel, order: Any = None
) -> CriticWorker:
    """This rank's share of the value model, built from ``critic.model`` (default the
    policy's) with the trainer's layout, or its own on ranks of its own
    (``CriticConfig.trainer_section``; ``order``: the job's store there)."""
    section = job.critic.trainer_section(job.trainer)
    critic = Critic(
        section=section,
        model_dir=ensure_model(section.model),
        pgc=pgc,
        device=job.cluster.device,
        tp_field="critic.tp_size" if job.critic.own_ranks else "trainer.tp_size",
    )
    colocated = job.placement.mode != "decoupled"
    return CriticWorker(critic=critic, shards=shards, colocated=colocated, order=order)
