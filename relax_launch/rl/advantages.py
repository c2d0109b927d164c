"""Advantages the RL loop hands the trainer: one estimator per function over the rewards of each
prompt's group (GRPO, Dr.GRPO, RLOO, REINFORCE++ with a group baseline), DAPO's over-long reward
shaping, and the on-policy distillation term per token. Pure functions of lists, unit-tested
against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

EPS = 1e-6


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def grpo(groups: list[list[float]]) -> list[list[float]]:
    """Each reward minus its group's mean, over the group's standard deviation; a group whose
    rewards are all equal carries no signal (0)."""
    out = []
    for group in groups:
        mean, std = _mean(group), _std(group)
        out.append([(r - mean) / (std + EPS) if std > 0 else 0.0 for r in group])
    return out


def dr_grpo(groups: list[list[float]]) -> list[list[float]]:
    """Dr.GRPO: each reward minus its group's mean, not divided by the standard deviation (which
    favours groups that are nearly all right or all wrong)."""
    return [[r - _mean(group) for r in group] for group in groups]


def rloo(groups: list[list[float]]) -> list[list[float]]:
    """RLOO: each reward minus the mean of the *other* rewards of its group (leave one out)."""
    return [[r - (sum(group) - r) / (len(group) - 1) for r in group] for group in groups]


def reinforce_pp_baseline(groups: list[list[float]]) -> list[list[float]]:
    """REINFORCE++ with a group baseline: each reward minus its group's mean, then divided by
    the standard deviation of those over the whole batch (every sample counted once)."""
    centred = dr_grpo(groups)
    std = _std([a for group in centred for a in group])
    return [[a / (std + EPS) if std > 0 else 0.0 for a in group] for group in centred]


ESTIMATORS: dict[str, Callable[[list[list[float]]], list[list[float]]]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft over-long punishment: 0 up to ``max_tokens - buffer`` tokens, then falling
    linearly to ``-penalty`` at ``max_tokens``."""
    start = max_tokens - buffer
    if buffer <= 0 or length <= start:
        return 0.0
    return -penalty * min(length - start, buffer) / buffer


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
