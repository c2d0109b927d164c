"""One RL step of a colocated job (placement ``split`` or ``defer``): the roles take turns on the
shared ranks under the ``LifecycleCoordinator``; each turn is granted only once the previous
holder's offload is confirmed.

defer:  the trainer offloads grads + optimizer -> rollout onloads its weights -> weight sync
        (version = step) -> the trainer offloads its params -> rollout onloads its KV cache,
        generates, offloads -> the teacher onloads, scores (written back onto the samples),
        offloads -> the genrm the same (rewards) -> commit -> the trainer onloads -> train.
split:  the same up to the sync; then every inference role onloads at once (each on its own
        slice, in parallel), they generate and score in turn, all offload together -> commit ->
        train.

A failure in any phase fails the batch: nothing is committed and nothing trained; the error
names the phase, the role and its ranks. A stop abandons the batch in its generation or
scoring (not in a sync or a move of memory): the roles that hold the ranks offload, and the
trainer takes them back, so the checkpoint of the last trained step can be written. The
coordinator's event log (``coordinator.jsonl`` in
the run's log directory) records every grant, confirmation and commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from relax_launch.rl.context import RLContext, StepResult
from relax_launch.rl.dynamic_sampling import GroupSelection
from relax_launch.rl.interfaces import Coordinator, StepAbandoned, TurnRefused
from relax_launch.rl.phases import (
    RolloutBatch,
    finish_batch,
    generate,
    score_rewards,
    score_teacher,
    step_record,
    sync,
    timed,
    train,
)
from relax_launch.rl.samples import Sample


class PhaseError(RuntimeError):
    """A phase of a colocated step failed; the message names the phase, role and ranks."""


class BatchWork(Protocol):
    """What a colocated batch does inside its turns (``RLBatchWork``; a test scripts it)."""

    def sync(self) -> None: ...
    def generate(self) -> None: ...
    def score(self, role: str) -> None: ...
    def enough(self) -> bool: ...
    def finish(self) -> None: ...


@dataclass
class Turns:
    """Grants and releases through the coordinator, timing each and adding up bytes moved."""

    coordinator: Coordinator
    batch: int
    seconds: dict[str, float]
    moved: dict[str, float] = field(default_factory=dict)  # e.g. "engines_offloaded": bytes
    counting: threading.Lock = field(default_factory=threading.Lock)

    def take(self, role: str, parts: tuple[str, ...] | None = None, own_time: bool = True) -> None:
        self._move(role, "activate", parts, own_time)

    def give(self, role: str, parts: tuple[str, ...] | None = None, own_time: bool = True) -> None:
        self._move(role, "deactivate", parts, own_time)

    def take_all(self, roles: list[tuple[str, tuple[str, ...] | None]]) -> None:
        """Onload several roles at once (split: each on its own slice), timed together as
        ``onload_inference``; the first error raises."""
        self._all(self.take, roles, "onload_inference")

    def give_all(self, roles: list[tuple[str, tuple[str, ...] | None]]) -> None:
        self._all(self.give, roles, "offload_inference")

    def _all(self, move: Callable, roles: list[tuple[str, tuple[str, ...] | None]], name: str):
        # one wall time for the group: per-role times would overlap and add up past the step
        with timed(self.seconds, name), ThreadPoolExecutor(len(roles)) as pool:
            moving = [pool.submit(move, role, parts, False) for role, parts in roles]
        for done in moving:
            done.result()

    def _move(self, role: str, action: str, parts: tuple[str, ...] | None, own_time: bool) -> None:
        verb = "onload" if action == "activate" else "offload"
        name = f"{verb}_{role}" + (f"_{'+'.join(parts)}" if parts else "")
        with timed(self.seconds if own_time else {}, name), self.phase(name, role):
            result = getattr(self.coordinator, action)(role, parts, f"{self.batch}:{name}")
        key = f"{'trainer' if role == 'trainer' else 'engines'}_{verb}ed"
        with self.counting:  # split moves several roles at once
            self.moved[key] = self.moved.get(key, 0.0) + result.get("bytes", 0.0)

    @contextmanager
    def phase(self, name: str, role: str) -> Iterator[None]:
        """An error inside names the phase, the role and its ranks."""
        try:
            yield
        except (TurnRefused, PhaseError):
            raise  # already names the role and its ranks
        except Exception as exc:
            member = self.coordinator.members[role].describe()
            raise PhaseError(
                f"phase {name} of batch {self.batch} failed on {member}: {exc}"
            ) from exc


def produce(work: BatchWork, turns: Turns, *, split: bool, scorers: tuple[str, ...]) -> None:
    """Everything a colocated batch does before its commit, in the order of the module doc."""
    turns.give("trainer", ("grads", "optimizer"))
    turns.take("rollout", ("weights",))
    with turns.phase("sync", "rollout"):
        work.sync()
    turns.give("trainer", ("params",))
    if split:  # every inference role on its own slice, onloaded at once, for every round
        turns.take_all([("rollout", ("kv_cache",)), *((role, None) for role in scorers)])
        while True:
            with turns.phase("rollout", "rollout"):
                work.generate()
            for role in scorers:
                with turns.phase(role, role):
                    work.score(role)
            if work.enough():  # dynamic sampling may want another round
                break
        turns.give_all([(role, None) for role in ("rollout", *scorers)])
    else:
        turns.take("rollout", ("kv_cache",))
        with turns.phase("rollout", "rollout"):
            work.generate()
        turns.give("rollout")
        for role in scorers:
            turns.take(role)
            with turns.phase(role, role):
                work.score(role)
            turns.give(role)
    work.finish()


def run_batch(
    work: BatchWork,
    coordinator: Coordinator,
    batch: int,
    *,
    split: bool,
    seconds: dict[str, float] | None = None,
    scorers: tuple[str, ...] | None = None,
) -> Turns:
    """Produce and commit one batch, then give the trainer its ranks back; a failure fails the
    batch (nothing committed) and is raised. Each turn's time goes into ``seconds``; the
    scoring roles are the teacher and genrm the job has, unless ``scorers`` names them."""
    turns = Turns(coordinator, batch, {} if seconds is None else seconds)
    if scorers is None:
        scorers = tuple(r for r in ("teacher", "genrm") if r in coordinator.members)
    coordinator.begin_batch(batch)
    try:
        produce(work, turns, split=split, scorers=scorers)
        coordinator.commit_batch(batch)
    except BaseException as exc:
        coordinator.fail_batch(batch, str(exc))
        if isinstance(exc, StepAbandoned):
            hand_back(turns)
        raise
    turns.take("trainer")  # only a committed batch is trained on
    return turns


def hand_back(turns: Turns) -> None:
    """After a batch abandoned for a stop: every inference role offloads what it holds, in the
    order they were registered, then the trainer takes its ranks back (its checkpoint needs its
    parameters and optimizer state where they belong)."""
    for role in turns.coordinator.holding():
        turns.give(role)
    turns.take("trainer")


@dataclass
class RLBatchWork:
    """The RL loop's work in each turn: sync, generate, teacher/genrm scoring, advantages."""

    ctx: RLContext
    step: int
    seconds: dict[str, float]
    samples: list[Sample] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    rewarded: bool = False  # this round's rewards are in (the genrm's turn scored them)
    round_metrics: dict[str, float] = field(default_factory=dict)
    selection: GroupSelection | None = None  # dynamic sampling's rounds (split)
    batch: RolloutBatch | None = None

    def sync(self) -> None:
        self.metrics |= sync(self.ctx, self.step, self.seconds)

    def generate(self) -> None:
        with timed(self.seconds, "sync"):  # the parity probe, once the KV cache is back
            self.ctx.job.check_parity()
        with self.ctx.job.stop.abandonable():
            self.samples, self.cursor = generate(self.ctx, self.seconds)
        self.rewarded = False

    def score(self, role: str) -> None:
        if role == "teacher":
            with self.ctx.job.stop.abandonable():
                score_teacher(self.ctx, self.samples, self.seconds)
        else:  # the genrm judges inside the reward sources
            self.reward_round()

    def reward_round(self) -> None:
        """The round's rewards, once (in the genrm's turn, or after the last turn)."""
        if not self.rewarded:
            with self.ctx.job.stop.abandonable():
                self.round_metrics = score_rewards(self.ctx, self.samples, self.seconds)
            self.rewarded = True

    def enough(self) -> bool:
        """Whether the rounds so far fill the batch (always, without dynamic sampling)."""
        a = self.ctx.algorithm
        if not a.dynamic_sampling:
            return True
        self.reward_round()
        if self.selection is None:
            self.selection = GroupSelection(a, self.ctx.data.prompts_per_step)
        self.selection.add(self.samples, self.cursor, self.round_metrics)
        return self.selection.done

    def finish(self) -> None:
        self.reward_round()  # no genrm: function rewards need no lease
        if self.selection is not None:
            self.samples, self.cursor, self.round_metrics = self.selection.result()
        self.metrics |= self.round_metrics
        self.batch = finish_batch(self.ctx, self.samples, self.metrics, self.seconds, self.cursor)


@dataclass
class EvalWork:
    """An evaluation between steps (``eval``): the trained weights synced, the eval prompts
    sampled, and scored (in the genrm's turn when a reward source asks the judge)."""

    ctx: RLContext
    version: int
    samples: list[Sample] = field(default_factory=list)
    rewards: dict[str, float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def sync(self) -> None:
        self.ctx.job.sync_weights(self.version)

    def generate(self) -> None:
        self.ctx.job.check_parity()  # the parity probe, once the KV cache is back
        with self.ctx.job.stop.abandonable():
            self.samples = self.ctx.evaluation.sample(self.ctx.job.engines)

    def score(self, role: str) -> None:
        if role == "genrm":
            with self.ctx.job.stop.abandonable():
                self.rewards = self.ctx.rewards.score(self.samples)

    def enough(self) -> bool:
        return True

    def finish(self) -> None:
        if self.rewards is None:
            with self.ctx.job.stop.abandonable():
                self.rewards = self.ctx.rewards.score(self.samples)
        self.metrics = self.ctx.evaluation.summarize(self.samples, self.rewards)


class Colocated:
    """The step of a ``split`` or ``defer`` job: batch ``2 * step`` trains; batch ``2 * step +
    1`` evaluates the weights it trained when evaluation is due (the other schedules evaluate
    between steps, in ``rl/runner.py``)."""

    def __init__(self, ctx: RLContext, coordinator: Coordinator, num_steps: int) -> None:
        self.ctx, self.coordinator, self.num_steps = ctx, coordinator, num_steps
        self.split = ctx.job.plan.mode == "split"

    def step(self, step: int) -> StepResult:
        ctx, seconds = self.ctx, {}
        work = RLBatchWork(ctx, step, seconds)
        turns = run_batch(work, self.coordinator, 2 * step, split=self.split, seconds=seconds)
        metrics = train(ctx, work.samples, seconds, step)
        metrics |= {f"memory/{k}_gb": v / 1e9 for k, v in turns.moved.items()}
        if ctx.evaluation is not None and ctx.evaluation.due(step + 1, self.num_steps):
            metrics |= self.evaluate(step, seconds)
        return StepResult(step_record(ctx, step, work.batch, metrics), work.batch.cursor, seconds)

    def evaluate(self, step: int, seconds: dict[str, float]) -> dict[str, float]:
        """The evaluation batch, in turns of its own (one more round of onloads); abandoned
        by a stop, the step still counts (it trained)."""
        evaluation = EvalWork(self.ctx, step + 1)
        judge = tuple(r for r in ("genrm",) if r in self.coordinator.members)
        try:
            with timed(seconds, "eval"):
                batch = 2 * step + 1
                run_batch(evaluation, self.coordinator, batch, split=self.split, scorers=judge)
        except StepAbandoned:
            return {}
        return evaluation.metrics

    def close(self) -> None:
        self.coordinator.close()
