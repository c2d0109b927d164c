"""The RL step on rank 0: one function per step that lists its phases (the run around the
steps is ``rl/runner.py``).

rollout (N samples per prompt through the gateway) -> teacher scoring (logprobs written back
onto the samples) -> rewards (functions and the GenRM judge) -> advantages (GRPO, plus the
distillation term per token) -> Megatron train step (PPO-clip, optional KL to the initial
policy) -> weight sync (version = step + 1).

With ``algorithm.off_policy_steps: 1`` (decoupled placement) the first four phases of step k+1
run in a background thread while step k trains: the engines generate with the weights of step
k, the sync waits for that rollout to finish (so no sample mixes weight versions), and step k+1
trains on samples one version old. Every sample carries the weight version that generated it;
one older than ``off_policy_steps`` is not trained on (``samples_stale``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from relax_launch.inference.inprocess import EngineClients
from relax_launch.rl import agent, rollout
from relax_launch.rl.agent import RolloutFunction
from relax_launch.rl.async_rollout import ContinuousRollout
from relax_launch.rl.batch import assign_advantages, sample_metrics, shape_overlong, to_batch
from relax_launch.rl.config import AlgorithmConfig, DataConfig
from relax_launch.rl.data import Prompt, PromptCursor, PromptStream, prompt_ids
from relax_launch.rl.dynamic_sampling import keep_groups_with_signal
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample
from relax_launch.runtime.checkpoint import Checkpoints
from relax_launch.runtime.console import operator_log
from relax_launch.runtime.lifecycle import LifecycleCoordinator
from relax_launch.runtime.session import Session
from relax_launch.runtime.stop import StepAbandoned
from relax_launch.trainer.losses import LossSpec

# The background rollout's requests each time out after gateway.request_timeout_s (300 s by
# default); this bounds the wait for all of them with room to spare.
ROLLOUT_WAIT_S = 900.0
clock = time.perf_counter  # the phase clock


@dataclass
class RolloutBatch:
    """One step's scored samples, their metrics, the seconds each phase took, and the prompt
    position right after its prompts were drawn (what a checkpoint after training it saves)."""

    samples: list[Sample]
    metrics: dict[str, float]
    seconds: dict[str, float]
    cursor: PromptCursor


@dataclass
class RLContext:
    """What every step needs, built once (see ``rl.program.rl_program``)."""

    session: Session
    algorithm: AlgorithmConfig
    data: DataConfig
    prompts: PromptStream
    tokenizer: Any
    rewards: Rewards
    log: MetricsLog
    has_teacher: bool
    engines: EngineClients  # the engines, reached in process (rl/rollout.py)
    checkpoints: Checkpoints  # where they go: checkpoint.dir, else the run directory
    skipped_prompts: int = 0
    checkpoint_every: int | None = 0  # steps; 0: only at the end; None: only on a stop
    trained_cursor: PromptCursor = field(default_factory=PromptCursor)  # of the last trained batch
    seconds: dict[str, float] = field(default_factory=dict)  # this step's main-thread phases
    background: ThreadPoolExecutor | None = None  # off-policy: where the next rollout runs
    upcoming: Future[RolloutBatch] | None = None  # off-policy: the next step's batch
    coordinator: LifecycleCoordinator | None = None  # split/defer: who holds the shared ranks
    correction: str = "none"  # algorithm.rollout_correction with auto resolved (by the job)
    evaluation: Evaluation | None = None  # the eval section's prompts, when it has one
    agent: RolloutFunction | None = None  # rollout.function: conversations instead of replies
    continuous: ContinuousRollout | None = None  # algorithm.max_staleness: generating always

    @property
    def spec(self) -> LossSpec:
        a = self.algorithm
        return LossSpec(
            clip_low=a.clip_eps,
            clip_high=a.clip_eps_high or a.clip_eps,
            aggregation=a.loss_aggregation,
            kl_coef=a.kl_coef,
            ratio=a.policy_ratio,
            correction=self.correction,
            correction_cap=a.rollout_correction_cap,
            max_response_tokens=self.data.max_response_tokens,
        )


@contextmanager
def timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's seconds to ``seconds[name]`` (a phase may run more than once a step)."""
    started = clock()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + clock() - started


def rl_step(ctx: RLContext, step: int, num_steps: int) -> dict[str, float]:
    """One RL step; returns its metrics (the step's wall time is added by ``run``).

    A stop abandons the step while its batch is being made (``StepAbandoned``); once training
    began the step finishes, without its weight sync (the resumed job syncs at start-up)."""
    ctx.seconds = {}
    a = ctx.algorithm
    stop = ctx.session.stop
    with stop.abandonable():
        if ctx.upcoming is not None:  # generated while the previous step trained
            batch = ctx.upcoming.result()
        else:
            batch = collect(ctx, ctx.seconds)  # rollout -> teacher -> reward -> advantages
    stop.check()
    ctx.upcoming = None
    if ctx.background is not None and step + 1 < num_steps:
        ctx.upcoming = ctx.background.submit(collect, ctx, {})
    ctx.trained_cursor = batch.cursor
    bound = a.max_staleness or a.off_policy_steps
    stale = drop_stale(batch.samples, trainer_version=step, bound=bound)
    with timed(ctx.seconds, "train"):
        metrics = train(ctx, batch.samples)
    try:
        if ctx.upcoming is not None:
            with timed(ctx.seconds, "wait"), stop.abandonable():  # the engines must be idle
                wait_for_rollout(ctx.upcoming, step + 1)  # before they take weights
        stop.check()
    except StepAbandoned:  # trained: the step counts, its checkpoint comes next
        return step_record(ctx, step, batch, metrics, stale)
    with timed(ctx.seconds, "sync"):
        reports = sync(ctx, step + 1)
    metrics |= sync_metrics(reports, ctx.seconds["sync"]) | ctx.session.engine_metrics()
    return step_record(ctx, step, batch, metrics, stale)


def train(ctx: RLContext, samples: list[Sample]) -> dict[str, float]:
    """One trainer step on the samples; a batch with no token to train on (every response
    invalid, stale or filtered) leaves the weights as they are, counted in ``train_skipped``."""
    batch = to_batch(samples, ctx.algorithm.distill_coef)
    if not any(any(mask) for mask in batch.loss_mask):
        operator_log().warning("relax-launch: no sample of this step can be trained on: skipped")
        return {"train_skipped": 1}
    return ctx.session.train_step(batch, ctx.spec) | {"train_skipped": 0}


def sync(ctx: RLContext, version: int) -> list[dict[str, float]]:
    """The weight sync; with a continuous rollout, on engines it has paused (what they were
    generating continues with the new weights)."""
    if ctx.continuous is None:
        return ctx.session.sync_weights(version)
    ctx.continuous.pause()
    synced = version - 1
    try:
        reports = ctx.session.sync_weights(version)
        synced = version
    finally:
        ctx.continuous.resume(synced)
    return reports


def step_record(
    ctx: RLContext, step: int, batch: RolloutBatch, metrics: dict[str, float], stale: int
) -> dict[str, float]:
    """A trained step's metrics: the trainer's, the batch's, its phases and its weight versions."""
    # a conversation that failed before its first turn has no version
    versions = [int(s.weight_version) for s in batch.samples if s.weight_version.isdigit()]
    metrics |= batch.metrics
    if ctx.continuous is not None:  # how old the trained samples were, and how many resumed
        for age in range(ctx.algorithm.max_staleness + 1):
            metrics[f"async/samples_staleness_{age}"] = sum(step - v == age for v in versions)
        resumed = [s for s in batch.samples if len(set(s.token_versions or ())) > 1]
        metrics["async/resumed_samples"] = len(resumed)
        metrics["tokens_per_s"] = ctx.continuous.throughput()
    metrics |= {f"time/{k}": v for k, v in batch.seconds.items()}
    return {
        "step": step + 1,
        "weight_version": min(versions, default=step),
        "staleness": step - min(versions, default=step),
        "samples_stale": stale,
        "data/skipped_long_prompts": ctx.skipped_prompts,
        **metrics,
    }


def sync_metrics(reports: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """Where one weight sync spent its time (the slowest pipeline stage per phase), GB/s, the
    tensors the engines had to stage instead of receiving in place, and whether the sync had
    to be sent twice (``sync/repaired``)."""
    phases = ("export_s", "transfer_s", "engine_s", "control_s")
    metrics = {f"sync/{p}": max(r[p] for r in reports) for p in phases if reports}
    metrics["sync/gb_per_s"] = sum(r["num_bytes"] for r in reports) / 1e9 / max(seconds, 1e-9)
    metrics["sync/staged_tensors"] = sum(e["staged"] for r in reports for e in r["receivers"])
    metrics["sync/repaired"] = float(any(r.get("repaired") for r in reports))
    return metrics


def collect(ctx: RLContext, seconds: dict[str, float]) -> RolloutBatch:
    """Rollout, teacher scoring, rewards and advantages: everything a train step consumes."""
    samples, cursor, metrics = score_round(ctx, seconds)
    if ctx.algorithm.dynamic_sampling:
        samples, cursor, metrics = keep_groups_with_signal(
            ctx.algorithm,
            ctx.data.prompts_per_step,
            lambda: score_round(ctx, seconds),
            (samples, cursor, metrics),
        )
    return finish_batch(ctx, samples, metrics, seconds, cursor)


def score_round(
    ctx: RLContext, seconds: dict[str, float]
) -> tuple[list[Sample], PromptCursor, dict[str, float]]:
    """One round of the step's prompts: generated, scored by the teacher and rewarded."""
    samples, cursor = generate(ctx, seconds)
    if ctx.has_teacher:
        score_teacher(ctx, samples, seconds)
    return samples, cursor, score_rewards(ctx, samples, seconds)


def generate(ctx: RLContext, seconds: dict[str, float]) -> tuple[list[Sample], PromptCursor]:
    """The step's prompts, N samples each; and the prompt position right after them."""
    a = ctx.algorithm
    with timed(seconds, "rollout"):
        if ctx.continuous is not None:  # groups the producer finished meanwhile
            samples = ctx.continuous.take(ctx.data.prompts_per_step, ROLLOUT_WAIT_S)
            return samples, ctx.prompts.checkpoint()
        prompts = next_prompts(ctx)
        cursor = ctx.prompts.checkpoint()
        sampling = {"n": a.n_samples_per_prompt, "temperature": a.temperature}
        sampling["max_tokens"] = ctx.data.max_response_tokens
        if ctx.agent is None:
            samples = rollout.generate(ctx.engines, prompts, **sampling)
        else:  # conversations of several turns (rl/agent.py)
            samples = agent.generate(
                ctx.engines, prompts, function=ctx.agent, tokenizer=ctx.tokenizer, **sampling
            )
    return samples, cursor


def score_teacher(ctx: RLContext, samples: list[Sample], seconds: dict[str, float]) -> None:
    """The teacher's logprobs of each response, written back onto its sample."""
    with timed(seconds, "teacher"):
        rollout.score_with_teacher(ctx.engines, samples)


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


def wait_for_rollout(upcoming: Future[RolloutBatch], step: int) -> None:
    """Block until the background rollout is done; its error, if any, is raised here."""
    try:
        upcoming.result(timeout=ROLLOUT_WAIT_S)
    except TimeoutError:
        raise TimeoutError(
            f"the background rollout of step {step + 1} did not finish within {ROLLOUT_WAIT_S:.0f}"
            " s; check the rollout engines' logs and the gateway's /metrics"
        ) from None


def drop_stale(samples: list[Sample], *, trainer_version: int, bound: int) -> int:
    """Mark samples generated more than ``bound`` weight versions ago as not trained on."""
    stale = 0
    for s in samples:
        if s.valid and trainer_version - int(s.weight_version) > bound:
            s.valid, stale = False, stale + 1
    return stale


def next_prompts(ctx: RLContext) -> list[tuple[Prompt, list[int]]]:
    """The step's prompts with their token ids; a prompt over max_prompt_tokens is skipped
    (counted in ``data/skipped_long_prompts``) and the next one taken."""
    chosen: list[tuple[Prompt, list[int]]] = []
    for _ in range(100 * ctx.data.prompts_per_step):
        if len(chosen) == ctx.data.prompts_per_step:
            return chosen
        prompt = ctx.prompts.next_batch(1)[0]
        ids = prompt_ids(ctx.tokenizer, prompt)
        if len(ids) > ctx.data.max_prompt_tokens:
            ctx.skipped_prompts += 1
            continue
        chosen.append((prompt, ids))
    raise RuntimeError(
        f"data.dataset: almost every prompt is longer than data.max_prompt_tokens="
        f"{ctx.data.max_prompt_tokens}; raise it or shorten the prompts"
    )
