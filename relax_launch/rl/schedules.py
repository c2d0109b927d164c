"""One step function per schedule, chosen once when the program starts (``rl/program.py``):

- ``Synchronous``: collect (rollout -> scoring -> advantages), train, sync: every sample comes
  from the weights of the step before.
- ``OffPolicy`` (``algorithm.off_policy_steps: 1``, decoupled): the next step's batch is
  collected in a background thread while this step trains, with this step's weights; the sync
  waits for it to finish (no sample mixes weight versions), and the next step trains on
  samples one version old.
- ``FullyAsync`` (``algorithm.max_staleness: k``, decoupled): the rollout engines generate all
  the time (``rl/async_rollout.py``); a step takes the groups that finished, and the sync
  pauses generation, which then continues with the new weights.
- ``Colocated`` (``split``, ``defer``): in ``rl/colocated.py``.

Each step reads top to bottom as the algorithm and returns a ``StepResult``. A stop abandons
the step while its batch is being made (``StepAbandoned``, in an abandonable wait); once
training began the step finishes, without its weight sync (the resumed job syncs at start-up).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from relax_launch.rl.async_rollout import ContinuousRollout
from relax_launch.rl.context import RLContext, StepResult
from relax_launch.rl.control import StalenessControl
from relax_launch.rl.interfaces import StepAbandoned
from relax_launch.rl.phases import (
    RolloutBatch,
    drop_stale,
    step_record,
    sync,
    timed,
    train,
    wait_for_rollout,
)
from relax_launch.rl.samples import Sample


class Schedule(Protocol):
    def step(self, step: int) -> StepResult: ...
    def close(self) -> None: ...


class Synchronous:
    """Collect, train, sync: on-policy, one version per step."""

    def __init__(self, ctx: RLContext) -> None:
        self.ctx = ctx

    def step(self, step: int) -> StepResult:
        ctx, stop, seconds = self.ctx, self.ctx.job.stop, {}
        with stop.abandonable():
            batch = ctx.collect(ctx, seconds)
        stop.check()
        metrics = train(ctx, batch.samples, seconds, step)
        if not stop.requested():  # trained: the step counts even if a stop came meanwhile
            metrics |= sync(ctx, step + 1, seconds)
        return StepResult(step_record(ctx, step, batch, metrics), batch.cursor, seconds)

    def close(self) -> None:
        pass


class OffPolicy:
    """The next step's batch is collected while this one trains (see the module docstring)."""

    def __init__(self, ctx: RLContext, num_steps: int) -> None:
        self.ctx, self.num_steps = ctx, num_steps
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-rollout")
        self.upcoming: Future[RolloutBatch] | None = None  # the next step's batch

    def step(self, step: int) -> StepResult:
        ctx, stop, seconds = self.ctx, self.ctx.job.stop, {}
        with stop.abandonable():
            upcoming, self.upcoming = self.upcoming, None
            batch = upcoming.result() if upcoming else ctx.collect(ctx, seconds)
        stop.check()
        if step + 1 < self.num_steps:
            self.upcoming = self.background.submit(ctx.collect, ctx, {})
        stale = drop_stale(batch.samples, trainer_version=step, bound=1)
        metrics = train(ctx, batch.samples, seconds, step)
        try:
            if self.upcoming is not None:  # the engines must be idle before they take weights
                with timed(seconds, "wait"), stop.abandonable():
                    wait_for_rollout(self.upcoming, step + 1, ctx.rollout_wait_s)
            stop.check()
        except StepAbandoned:  # trained: the step counts, its checkpoint comes next
            return StepResult(step_record(ctx, step, batch, metrics, stale), batch.cursor, seconds)
        metrics |= sync(ctx, step + 1, seconds)
        return StepResult(step_record(ctx, step, batch, metrics, stale), batch.cursor, seconds)

    def close(self) -> None:
        # on an error or a stop, do not wait for a rollout nobody needs
        self.background.shutdown(wait=False, cancel_futures=True)


class FullyAsync:
    """Steps take finished groups from a rollout that never stops (see the module docstring)."""

    def __init__(
        self, ctx: RLContext, rollout: ContinuousRollout, control: StalenessControl | None = None
    ) -> None:
        self.ctx, self.rollout, self.control = ctx, rollout, control  # control: algorithm.control
        ctx.job.stop.listeners.append(lambda why: rollout.close())  # a stop ends generation
        rollout.start()

    def step(self, step: int) -> StepResult:
        ctx, stop, seconds = self.ctx, self.ctx.job.stop, {}
        requests = ctx.data.prompts_per_step * ctx.algorithm.n_samples_per_prompt
        self.rollout.busy_seconds()  # the rollout phase is this step's stretch before its sync
        with ctx.job.rollout_phase(requests) as phase:
            with stop.abandonable():
                batch = ctx.collect(ctx, seconds, self.finished_groups)
            stop.check()
            stale = drop_stale(batch.samples, trainer_version=step, bound=self.rollout.k)
            metrics = train(ctx, batch.samples, seconds, step)
            phase.busy_s, phase.waited_s = self.rollout.busy_seconds(), seconds["rollout"]
        if not stop.requested():
            self.rollout.pause()  # what the engines were generating continues after the sync
            synced = step
            try:
                metrics |= sync(ctx, step + 1, seconds)
                synced = step + 1
            finally:
                self.rollout.resume(synced)
        row = step_record(ctx, step, batch, metrics, stale)
        if self.control is not None:  # the bound the producer and the next step keep to
            row |= self.control.after_step(row)
            self.rollout.k = self.control.bound
        return StepResult(row | self.async_metrics(step, batch.samples), batch.cursor, seconds)

    def finished_groups(
        self, ctx: RLContext, seconds: dict[str, float]
    ) -> tuple[list[Sample], object]:
        """The step's groups, as the producer finished them (its draw of ``collect``)."""
        with timed(seconds, "rollout"):
            samples = self.rollout.take(ctx.data.prompts_per_step, ctx.rollout_wait_s)
            return samples, ctx.feed.position()

    def async_metrics(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """How old the trained samples were, how many resumed, and generation throughput."""
        versions = [int(s.weight_version) for s in samples if s.weight_version.isdigit()]
        metrics = {
            f"async/samples_staleness_{age}": sum(step - v == age for v in versions)
            for age in range(self.ctx.algorithm.max_staleness + 1)
        }
        resumed = [s for s in samples if len(set(s.token_versions or ())) > 1]
        metrics["async/resumed_samples"] = len(resumed)
        metrics["async/image_restarts"] = self.rollout.image_restarts()
        metrics["async/image_samples_given_up"] = self.rollout.image_samples_given_up()
        metrics["tokens_per_s"] = self.rollout.throughput()
        return metrics

    def close(self) -> None:
        self.rollout.close()
