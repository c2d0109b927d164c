"""PPO's train step with a learned value model (``algorithm.advantage_estimator: gae``): the
critic scores the batch (V_old, before any update), GAE gives each response token its
advantage (whitened over the batch's trained tokens) and return, the policy trains on those
advantages, then the critic on the returns (``rl/gae.py``, ``trainer/critic.py``)."""

from __future__ import annotations

from dataclasses import replace

from relax_launch.rl.context import RLContext
from relax_launch.rl.gae import explained_variance, gae, masked_mean, returns, whiten
from relax_launch.rl.samples import Sample
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.critic_loss import critic_batch
from relax_launch.trainer.losses import LossSpec


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


def train_critic(ctx: RLContext, batch: TokenBatch) -> dict[str, float]:
    """``critic.mini_batches`` value-model steps, each on its contiguous part of ``batch`` (old
    values from before the first); each metric's mean over them."""
    parts = ctx.critic.mini_batches
    size = len(batch) // parts
    steps = [
        ctx.job.train_critic(batch.select(range(i * size, (i + 1) * size)), ctx.critic.value_clip)
        for i in range(parts)
    ]
    return {key: sum(s[key] for s in steps) / parts for key in steps[0]}


def train_with_critic(
    ctx: RLContext, samples: list[Sample], batch: TokenBatch, spec: LossSpec
) -> dict[str, float]:
    """V_old, GAE, the policy's step on the whitened advantages, then the critic's step; the
    trainer's metrics, ``critic/*``, and in a colocated placement the bytes the critic's turns
    moved (``memory/*``). The value model's state moves between the moments as the job's
    ``critic_turns`` says (``runtime/critic_turns.py``); the turn ends as it began, also on a
    failure."""
    a, turns = ctx.algorithm, ctx.job.critic_turns
    try:
        turns.scoring()
        values = ctx.job.critic_values(batch)
        advantages, targets = advantages_and_returns(samples, values, a.gamma, a.lam)
        masks = [list(m[1:]) for m in batch.loss_mask]
        whitened = whiten(advantages, masks)
        policy = replace(batch, token_weights=tuple((0.0, *row) for row in whitened))
        turns.policy_training()
        metrics = ctx.job.train_step(policy, spec)
        shifted = critic_batch(batch, [[0.0, *r] for r in targets], [[0.0, *v] for v in values])
        turns.critic_training()
        metrics |= train_critic(ctx, shifted)
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
        }
    )
