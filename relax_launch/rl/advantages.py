"""Per-token advantages the RL loop hands the trainer: GRPO's group-normalised rewards and the
on-policy distillation term (pure functions of lists, unit-tested against hand-computed values).
"""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation.

    Groups are consecutive runs of ``group_size`` rewards (the samples of one prompt). A group
    whose rewards are all equal carries no signal: its advantages are 0.
    """
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / group_size)
        out += [(r - mean) / (std + eps) if std > 0 else 0.0 for r in group]
    return out


def distill_advantages(
    sample_logprobs: list[float], teacher_logprobs: list[float], coef: float
) -> list[float]:
    """Per-token advantage of on-policy distillation: ``coef * (teacher - student)`` logprob.

    A policy-gradient step with it lowers the reverse KL(student || teacher) on the tokens the
    student sampled.
    """
    if len(sample_logprobs) != len(teacher_logprobs):
        raise ValueError(
            f"teacher scored {len(teacher_logprobs)} tokens for a {len(sample_logprobs)}-token "
            "response"
        )
    return [coef * (t - s) for s, t in zip(sample_logprobs, teacher_logprobs, strict=True)]
