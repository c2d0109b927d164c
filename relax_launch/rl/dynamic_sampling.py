"""DAPO's dynamic sampling: a group whose rewards are all equal has no advantage, so it teaches
nothing; the step draws more rounds of prompts until its batch is full of groups with signal,
within a bound, and fills what is still missing with groups without (advantage 0)."""

from __future__ import annotations

from collections.abc import Callable

from relax_launch.rl.batch import groups, has_signal
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.samples import Sample

Round = tuple[list[Sample], PromptCursor, dict[str, float]]  # scored samples, cursor, metrics


def keep_groups_with_signal(
    algorithm: AlgorithmConfig, wanted: int, draw: Callable[[], Round], first: Round
) -> Round:
    """From the ``first`` round on, ``draw`` rounds until ``wanted`` groups have rewards that
    differ, at most ``algorithm.dynamic_sampling_max_rounds`` in all. Returns the chosen groups'
    samples (renumbered), the cursor after the last round, and the metrics: every round's reward
    metrics merged (over every drawn sample) plus the rounds and groups drawn."""
    samples, cursor, metrics = first
    kept: list[list[Sample]] = []
    flat: list[list[Sample]] = []
    rounds = [metrics]
    while True:
        for group in groups(samples, algorithm.n_samples_per_prompt):
            (kept if has_signal(group) else flat).append(group)
        if len(kept) >= wanted or len(rounds) == algorithm.dynamic_sampling_max_rounds:
            break
        samples, cursor, more = draw()
        rounds.append(more)
    padded = max(wanted - len(kept), 0)
    chosen = kept[:wanted] + flat[:padded]
    for number, group in enumerate(chosen):
        for s in group:
            s.group = number
    merged = {k: merge(k, [m[k] for m in rounds]) for k in rounds[0]}
    merged |= {
        "data/sampling_rounds": len(rounds),
        "data/groups_without_signal": len(flat),
        "data/groups_padded": padded,
        "data/response_tokens_drawn": sum(len(s.response_ids) for g in kept + flat for s in g),
    }
    return [s for group in chosen for s in group], cursor, merged


def merge(key: str, values: list[float]) -> float:
    """One metric over rounds of equal size: a source's mean reward averages, counts add up."""
    mean = key.startswith("reward/") and not key.endswith("/failed")
    return sum(values) / len(values) if mean else sum(values)
