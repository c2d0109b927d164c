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


class GroupSelection:
    """The groups of one step's rounds, sorted into those with signal and those without."""

    def __init__(self, algorithm: AlgorithmConfig, wanted: int) -> None:
        self.algorithm, self.wanted = algorithm, wanted
        self.kept: list[list[Sample]] = []
        self.flat: list[list[Sample]] = []
        self.rounds: list[dict[str, float]] = []
        self.cursor = PromptCursor()

    def add(self, samples: list[Sample], cursor: PromptCursor, metrics: dict[str, float]) -> None:
        for group in groups(samples, self.algorithm.n_samples_per_prompt):
            (self.kept if has_signal(group) else self.flat).append(group)
        self.cursor = cursor
        self.rounds.append(metrics)

    @property
    def done(self) -> bool:
        """Whether the batch is full, or the rounds are spent."""
        spent = len(self.rounds) >= self.algorithm.dynamic_sampling_max_rounds
        return len(self.kept) >= self.wanted or spent

    def result(self) -> Round:
        """The chosen groups' samples (renumbered), the cursor after the last round, and the
        metrics: every round's reward metrics merged (over every drawn sample) plus the rounds
        and groups drawn."""
        padded = max(self.wanted - len(self.kept), 0)
        chosen = self.kept[: self.wanted] + self.flat[:padded]
        for number, group in enumerate(chosen):
            for s in group:
                s.group = number
        merged = {k: merge(k, [m[k] for m in self.rounds]) for k in self.rounds[0]}
        drawn = self.kept + self.flat
        merged |= {
            "data/sampling_rounds": len(self.rounds),
            "data/groups_without_signal": len(self.flat),
            "data/groups_padded": padded,
            "data/response_tokens_drawn": sum(len(s.response_ids) for g in drawn for s in g),
        }
        return [s for group in chosen for s in group], self.cursor, merged


def keep_groups_with_signal(
    algorithm: AlgorithmConfig, wanted: int, draw: Callable[[], Round], first: Round
) -> Round:
    """From the ``first`` round on, ``draw`` rounds until ``wanted`` groups have rewards that
    differ, at most ``algorithm.dynamic_sampling_max_rounds`` in all (``GroupSelection``)."""
    selection = GroupSelection(algorithm, wanted)
    selection.add(*first)
    while not selection.done:
        selection.add(*draw())
    return selection.result()


def merge(key: str, values: list[float]) -> float:
    """One metric over rounds of equal size: a source's mean reward averages, counts add up."""
    mean = key.startswith("reward/") and not key.endswith("/failed")
    return sum(values) / len(values) if mean else sum(values)
