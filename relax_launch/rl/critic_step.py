"""PPO's train step with a learned value model (``algorithm.advantage_estimator: gae``): the
critic scores the batch (V_old, before any update), GAE gives each response token its
advantage (whitened over the batch's trained tokens) and return, the policy trains on those
advantages, then the critic on the returns (``rl/gae.py``, ``trainer/critic.py``); a critic on
ranks of its own trains on them while the policy trains."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from time import monotonic
from typing import TYPE_CHECKING

from relax_launch.rl.gae import explained_variance, gae, masked_mean, returns, whiten
from relax_launch.rl.samples import Sample
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.critic import STEP_SECONDS, STEP_TICKETS
from relax_launch.trainer.critic_loss import critic_batch
from relax_launch.trainer.losses import LossSpec

if TYPE_CHECKING:
    from relax_launch.rl.context import RLContext


def advantages_and_returns(
    samples: list[Sample], values: list[list[float]], gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Per target position (``tokens[1:]``) of each sample: GAE advantages and returns over its
    response tokens, 0 over its prompt. ``values[i][j]`` is the critic's value of the state
    before token ``j + 1`` of sample ``i``, so its response starts at ``len(prompt) - 1``."""
    advantages, targets = [], []
    for sample, row in zip(samples, values, strict=True):
        start = len(sample.prompt_ids) - 1
        response = row[start:]
        estimated = gae(response, sample.reward, gamma, lam)
        advantages.append([0.0] * start + estimated)
        targets.append([0.0] * start + returns(estimated, response))
    return advantages, targets


@dataclass(frozen=True)
class PolicySpan:
    """The policy's step beside the critic's on rank 0: its seconds, and the job's event
    tickets (``Job.order_ticket``) taken just before and just after it."""

    seconds: float
    began: int
    ended: int


def train_policy_and_critic(
    ctx: RLContext, policy_step: Callable[[], dict[str, float]] | None, batch: TokenBatch
) -> dict[str, float]:
    """The policy's step (``policy_step``; None in the critic's warm-up) and
    ``critic.mini_batches`` value-model steps, each on its contiguous part of ``batch`` (old
    values from before the first). On the trainer's ranks the critic trains after the policy;
    on ranks of its own (``critic.ranks: own``) rank 0 posts the critic's steps first and both
    train at once. The policy's metrics and ``critic_metrics`` of the critic's steps."""
    job = ctx.job
    if not job.critic_overlaps:
        metrics = policy_step() if policy_step else {}
        job.critic_turns.critic_training()
        steps = [job.train_critic(b, ctx.critic.value_clip) for b in _mini_batches(ctx, batch)]
        return metrics | critic_metrics(steps)
    begun = monotonic()  # rank 0's clock only: the critic's ranks report durations
    started = job.start_critic(_mini_batches(ctx, batch), ctx.critic.value_clip)
    policy, metrics = None, {}
    if policy_step is not None:
        policy_begun, first = monotonic(), job.order_ticket()
        try:
            metrics = policy_step()
        except BaseException:  # the critic's sends end before the job's shutdown
            with contextlib.suppress(Exception):
                job.finish_critic(started)
            raise
        policy = PolicySpan(monotonic() - policy_begun, first, job.order_ticket())
    steps = job.finish_critic(started)
    return metrics | critic_metrics(steps, policy, monotonic() - begun)


def _mini_batches(ctx: RLContext, batch: TokenBatch) -> list[TokenBatch]:
    parts = ctx.critic.mini_batches
    size = len(batch) // parts
    return [batch.select(range(i * size, (i + 1) * size)) for i in range(parts)]


def critic_metrics(
    steps: list[dict[str, float]], policy: PolicySpan | None = None, wall_s: float | None = None
) -> dict[str, float]:
    """Each metric's mean over the critic's steps; ``critic/step_s``, the steps' summed
    durations on the critic's ranks; with ``policy`` (the policy's step on rank 0) and
    ``wall_s`` (from posting the critic's steps to collecting the last, on rank 0)
    ``critic/overlap_s``: how long the two trained at once (``policy.seconds + step_s -
    wall_s``, at least 0), ``critic/overlap_fraction``: that share of the shorter of the two (1:
    it ran entirely within the other), both from durations only (no two machines' clocks meet),
    and ``critic/overlapped_steps``: the critic's steps that ran, at least in part, while the
    policy's did, by the order of their tickets (``STEP_TICKETS``) and the policy's: a step
    that began before the policy's ended and ended after it began. No clock at all."""
    critic_s = sum(s.pop(STEP_SECONDS) for s in steps)
    tickets = [tuple(s.pop(key, None) for key in STEP_TICKETS) for s in steps]
    metrics = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
    metrics["critic/step_s"] = critic_s
    if policy is not None and wall_s is not None:
        overlap = max(0.0, policy.seconds + critic_s - wall_s)
        shorter = min(critic_s, policy.seconds)
        metrics["critic/overlap_s"] = overlap
        metrics["critic/overlap_fraction"] = min(1.0, overlap / shorter) if shorter > 0 else 0.0
        metrics["critic/overlapped_steps"] = float(
            sum(b < policy.ended and e > policy.began for b, e in tickets if b is not None)
        )
    return metrics


def train_with_critic(
    ctx: RLContext,
    samples: list[Sample],
    batch: TokenBatch,
    spec: LossSpec,
    train_policy: bool = True,
) -> dict[str, float]:
    """V_old, GAE, the policy's step on the whitened advantages (skipped in the critic's
    warm-up, ``train_policy`` False: ``critic.warmup_steps``), then the critic's step; the
    trainer's metrics, ``critic/*``, and in a colocated placement the bytes the critic's turns
    moved (``memory/*``). The value model's state moves between the moments as the job's
    ``critic_turns`` says (``runtime/critic_turns.py``), the same in the warm-up; the turn ends
    as it began, also on a failure."""
    a, turns = ctx.algorithm, ctx.job.critic_turns
    try:
        turns.scoring()
        values = ctx.job.critic_values(batch)
        advantages, targets = advantages_and_returns(samples, values, a.gamma, a.lam)
        masks = [list(m[1:]) for m in batch.loss_mask]
        whitened = whiten(advantages, masks)
        policy = replace(batch, token_weights=tuple((0.0, *row) for row in whitened))
        turns.policy_training()
        shifted = critic_batch(batch, [[0.0, *r] for r in targets], [[0.0, *v] for v in values])
        metrics = train_policy_and_critic(
            ctx, (lambda: ctx.job.train_step(policy, spec)) if train_policy else None, shifted
        )
    finally:
        turns.done()
    moved = {f"memory/{k}_gb": v / 1e9 for k, v in turns.take_moved().items()}
    return (
        metrics
        | moved
        | {
            "critic/explained_variance": explained_variance(values, targets, masks),
            "critic/value_mean": masked_mean(values, masks),
            "critic/return_mean": masked_mean(targets, masks),
            "critic/warmup": float(not train_policy),
        }
    )
