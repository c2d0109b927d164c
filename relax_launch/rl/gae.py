"""PPO's advantages from a learned value model: per-token GAE over each response, returns,
whitening over the batch, and the critic's explained variance. Pure functions of lists (the
value loss itself is a tensor function: ``trainer/critic_loss.py``), unit-tested against
hand-computed values.

Rewards: the sample's reward on its last response token, 0 on the others. The KL penalty to the
reference policy (``algorithm.kl_coef``) is not folded into the rewards: it stays a term of the
policy loss (``trainer/losses.py``), as with every other estimator, so the critic learns the
task's return alone.
"""

from __future__ import annotations

import math

EPS = 1e-8


def gae(values: list[float], reward: float, gamma: float, lam: float) -> list[float]:
    """Generalised advantage estimates of one response: ``values[t]`` is V of the state before
    response token ``t``; the reward comes at the last token and the episode ends there (V = 0
    after it). ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``."""
    advantages = [0.0] * len(values)
    running = 0.0
    for t in reversed(range(len(values))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        rewarded = reward if t == len(values) - 1 else 0.0
        delta = rewarded + gamma * following - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


def returns(advantages: list[float], values: list[float]) -> list[float]:
    """The critic's regression targets: ``R_t = A_t + V_t`` (the lambda-return)."""
    return [a + v for a, v in zip(advantages, values, strict=True)]


def whiten(rows: list[list[float]], masks: list[list[float]]) -> list[list[float]]:
    """Advantages minus their mean over the batch's trained tokens (mask > 0), over their
    standard deviation (as PPO does); untrained positions are 0."""
    kept = masked(rows, masks)
    if not kept:
        return [[0.0] * len(row) for row in rows]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((a - mean) ** 2 for a in kept) / len(kept))
    return [
        [(a - mean) / (std + EPS) if m > 0 else 0.0 for a, m in zip(row, mask, strict=True)]
        for row, mask in zip(rows, masks, strict=True)
    ]


def masked(rows: list[list[float]], masks: list[list[float]]) -> list[float]:
    """The values of every row at its trained positions (mask > 0), in order."""
    return [
        x
        for row, mask in zip(rows, masks, strict=True)
        for x, m in zip(row, mask, strict=True)
        if m > 0
    ]


def masked_mean(rows: list[list[float]], masks: list[list[float]]) -> float:
    """The mean over the trained positions (NaN when there is none)."""
    kept = masked(rows, masks)
    return sum(kept) / len(kept) if kept else float("nan")


def explained_variance(
    values: list[list[float]], targets: list[list[float]], masks: list[list[float]]
) -> float:
    """``1 - Var(R - V) / Var(R)`` over the trained tokens: 1 when the critic predicts the
    returns exactly, 0 when it does no better than their mean (NaN when the returns are
    constant)."""
    pairs = [
        (v, r)
        for vs, rs, ms in zip(values, targets, masks, strict=True)
        for v, r, m in zip(vs, rs, ms, strict=True)
        if m > 0
    ]
    if not pairs:
        return float("nan")
    var_r = _variance([r for _, r in pairs])
    if var_r == 0:
        return float("nan")
    return 1.0 - _variance([r - v for v, r in pairs]) / var_r


def _variance(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)
