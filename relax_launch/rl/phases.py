"""The phases of an RL step, shared by every schedule (``rl/schedules.py``, ``rl/colocated.py``):

rollout (N samples per prompt through the controller's engine clients) -> teacher scoring
(logprobs written back onto the samples) -> rewards (functions and the GenRM judge, then
over-long shaping) -> advantages (GRPO, plus the distillation term per token) -> Megatron train
step (PPO-clip, optional KL to the initial policy) -> weight sync (version = step + 1).

Each phase takes the context and the step's ``seconds`` (where it adds its own time) and returns
what it made; none of them looks at which schedule runs it. Which variants a job runs is chosen
once, by the program, into the context: ``score`` (``score_rewards``, or
``teacher_then_rewards``) and ``collect`` (``collect_once``, or ``collect_until_signal`` with
dynamic sampling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from relax_launch.console import operator_log
from relax_launch.rl.batch import assign_advantages, sample_metrics, shape_overlong, to_batch
from relax_launch.rl.context import RLContext
from relax_launch.rl.critic_step import train_with_critic
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.dynamic_sampling import keep_groups_with_signal
from relax_launch.rl.rollout import score_with_teacher
from relax_launch.rl.samples import Sample

clock = time.perf_counter  # the phase clock


@dataclass
class RolloutBatch:
    """One step's scored samples, their metrics, the seconds each phase took, and the prompt
    position right after its prompts were drawn (what a checkpoint after training it saves)."""

    samples: list[Sample]
    metrics: dict[str, float]
    seconds: dict[str, float]
    cursor: PromptCursor


Round = tuple[list[Sample], PromptCursor, dict[str, float]]  # scored samples, cursor, metrics


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's seconds to ``seconds[name]`` (a phase may run more than once a step)."""
    started = clock()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + clock() - started


def generate(ctx: RLContext, seconds: dict[str, float]) -> tuple[list[Sample], PromptCursor]:
    """The step's prompts, N samples each (replies, or conversations with a rollout
    function); and the prompt position right after them."""
    with timed(seconds, "rollout"):
        prompts = ctx.feed.draw()
        cursor = ctx.feed.position()
        sampling = ctx.sampling()
        with ctx.job.rollout_phase(len(prompts) * sampling["n"]):  # the rollout autoscaler's
            return ctx.generator(ctx.job.engines, prompts, **sampling), cursor


def score_teacher(ctx: RLContext, samples: list[Sample], seconds: dict[str, float]) -> None:
    """The teacher's logprobs of each response, written back onto its sample."""
    with timed(seconds, "teacher"):
        score_with_teacher(ctx.job.engines, samples, ctx.tokenizer)


def score_rewards(
    ctx: RLContext, samples: list[Sample], seconds: dict[str, float]
) -> dict[str, float]:
    """Every reward source (functions and the GenRM judge), then over-long shaping; returns
    their metrics."""
    with timed(seconds, "reward"):
        metrics = ctx.rewards.score(samples)
        metrics["samples_truncated"] = shape_overlong(
            samples, ctx.algorithm, ctx.data.max_response_tokens
        )
        return metrics


def teacher_then_rewards(
    ctx: RLContext, samples: list[Sample], seconds: dict[str, float]
) -> dict[str, float]:
    """The scoring of a job with a teacher: its logprobs, then the rewards."""
    score_teacher(ctx, samples, seconds)
    return score_rewards(ctx, samples, seconds)


Draw = Callable[[RLContext, dict[str, float]], tuple[list[Sample], PromptCursor]]


def collect_once(ctx: RLContext, seconds: dict[str, float], draw: Draw = generate) -> RolloutBatch:
    """Samples from ``draw`` (default: generate the step's prompts), scored (``ctx.score``),
    with their advantages: everything a train step consumes."""
    samples, cursor = draw(ctx, seconds)
    metrics = ctx.score(ctx, samples, seconds)
    return finish_batch(ctx, samples, metrics, seconds, cursor)


def collect_until_signal(
    ctx: RLContext, seconds: dict[str, float], draw: Draw = generate
) -> RolloutBatch:
    """``collect_once`` with dynamic sampling: more rounds until the batch holds groups whose
    rewards differ (``rl/dynamic_sampling.py``)."""

    def scored_round() -> Round:
        samples, cursor = draw(ctx, seconds)
        return samples, cursor, ctx.score(ctx, samples, seconds)

    wanted = ctx.data.prompts_per_step
    round_ = keep_groups_with_signal(ctx.algorithm, wanted, scored_round, scored_round())
    return finish_batch(ctx, round_[0], round_[2], seconds, round_[1])


def finish_batch(
    ctx: RLContext,
    samples: list[Sample],
    metrics: dict[str, float],
    seconds: dict[str, float],
    cursor: PromptCursor,
) -> RolloutBatch:
    """Advantages and the sample metrics: the batch a train step consumes."""
    a = ctx.algorithm
    assign_advantages(samples, a.n_samples_per_prompt, a.advantage_estimator)
    drawn = metrics.get("data/response_tokens_drawn")
    metrics |= sample_metrics(samples, seconds["rollout"], drawn)
    return RolloutBatch(samples, metrics, dict(seconds), cursor)


def train(
    ctx: RLContext, samples: list[Sample], seconds: dict[str, float], version: int
) -> dict[str, float]:
    """One trainer step on the samples, with the trainer at weights ``version``; a batch with
    no token to train on (every response invalid, stale or filtered) leaves the weights as they
    are, counted in ``train_skipped``. Under the mismatch guard's ``skip`` the trainer holds
    the batch to the guard's bounds for its staleness before it updates."""
    with timed(seconds, "train"):
        batch = to_batch(samples, ctx.algorithm.distill_coef)
        if not any(any(mask) for mask in batch.loss_mask):
            operator_log().warning("relax-launch: no sample of this step can be trained: skipped")
            return {"train_skipped": 1}
        spec = ctx.spec
        if ctx.guard is not None:
            versions = [int(s.weight_version) for s in samples if s.weight_version.isdigit()]
            staleness = version - min(versions, default=version)
            spec = replace(spec, withhold_above=ctx.guard.withhold_above(staleness))
        if ctx.critic is not None:  # PPO with a value model: GAE, policy, then critic
            policy = version >= ctx.critic.warmup_steps  # critic.warmup_steps: critic alone
            return train_with_critic(ctx, samples, batch, spec, policy) | {"train_skipped": 0}
        return ctx.job.train_step(batch, spec) | {"train_skipped": 0}


def sync(ctx: RLContext, version: int, seconds: dict[str, float]) -> dict[str, float]:
    """The weight sync to ``version``; returns its metrics."""
    with timed(seconds, "sync"):
        reports = ctx.job.sync_weights(version)
    return sync_metrics(reports, seconds["sync"])


def sync_metrics(reports: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """Where one weight sync spent its time (summed over its broadcast groups, one per
    pipeline stage and EP rank, which send in turn; the session's open and close, ``control_s``,
    once), its bytes (a LoRA policy sends only its targeted weights), GB/s, the tensors the
    engines had to stage instead of receiving in place, and whether the sync had to be sent
    twice (``sync/repaired``)."""
    sent = ("export_s", "transfer_s", "engine_s")
    metrics = {f"sync/{p}": sum(r[p] for r in reports) for p in sent}
    metrics["sync/control_s"] = max((r["control_s"] for r in reports), default=0.0)
    metrics["sync/bytes"] = sum(r["num_bytes"] for r in reports)
    metrics["sync/gb_per_s"] = metrics["sync/bytes"] / 1e9 / max(seconds, 1e-9)
    metrics["sync/staged_tensors"] = sum(e["staged"] for r in reports for e in r["receivers"])
    metrics["sync/repaired"] = float(any(r.get("repaired") for r in reports))
    return metrics


def step_record(
    ctx: RLContext, step: int, batch: RolloutBatch, metrics: dict[str, float], stale: int = 0
) -> dict[str, float]:
    """A trained step's metrics: the trainer's, the batch's, its phases and weight versions, and
    the engines' state (also when a stop skipped the step's sync)."""
    # a conversation that failed before its first turn has no version
    versions = [int(s.weight_version) for s in batch.samples if s.weight_version.isdigit()]
    return {
        "step": step + 1,
        "weight_version": min(versions, default=step),
        "staleness": step - min(versions, default=step),
        "samples_stale": stale,
        "data/skipped_long_prompts": ctx.feed.skipped,
        **metrics,
        **ctx.job.engine_metrics(),
        **batch.metrics,
        **{f"time/{k}": v for k, v in batch.seconds.items()},
    }


def drop_stale(samples: list[Sample], *, trainer_version: int, bound: int) -> int:
    """Mark samples generated more than ``bound`` weight versions ago as not trained on."""
    stale = 0
    for s in samples:
        if s.valid and trainer_version - int(s.weight_version) > bound:
            s.valid, stale = False, stale + 1
    return stale


def wait_for_rollout(upcoming: Future[RolloutBatch], step: int, timeout_s: float) -> None:
    """Block until the background rollout is done, at most ``timeout_s`` (the context's
    ``rollout_wait_s``); its error, if any, is raised here."""
    try:
        upcoming.result(timeout=timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"the background rollout of step {step + 1} did not finish within {timeout_s:.0f} s "
            "(3 x gateway.request_timeout_s; raise it for a larger batch); check the rollout "
            "engines' logs and the gateway's /metrics"
        ) from None
