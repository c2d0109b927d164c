"""The ``data.reasoning_gym`` section: how ``data.dataset: reasoning_gym:TASK[+TASK...]``
draws its rows (how many, each task's own config, how the prompt asks for the answer and how
the reward finds it). Task names and task configs are checked against reasoning-gym when the
config is read, so a typo fails before any process starts."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from relax_launch.config.patterns import checked_pattern
from relax_launch.config.section import Section

PREFIX = "reasoning_gym:"
# reasoning-gym draws row i of a dataset from Random(seed + i): seeds s and s+1 would share all
# rows but one. A data seed maps to its own block of ROWS_PER_SEED generator seeds, so the rows of
# two data seeds (training and eval) come from disjoint generator seeds; below 2**31 because
# some tasks seed NumPy (which refuses 2**32 and over) with seed + i.
ROWS_PER_SEED = 2**20
SEED_BLOCKS = 2**31 // ROWS_PER_SEED
ANSWER_FORMAT = (
    "Think briefly, then give your final answer inside <answer></answer> tags, "
    "e.g. <answer>42</answer>."
)


class ReasoningGymConfig(Section):
    """reasoning-gym's procedural tasks as prompts (no downloads)."""

    size: int = Field(
        1000, ge=1, le=ROWS_PER_SEED, description="Rows generated of each task (at most 2^20)."
    )
    tasks: dict[str, dict[str, Any]] = Field(
        {},
        description="Each task's own config (reasoning-gym's fields of that task, e.g. "
        "{chain_sum: {min_terms: 2, max_terms: 3}}); a task not named uses its defaults.",
    )
    answer_format: str = Field(
        ANSWER_FORMAT,
        description="Appended to every question: how to state the answer (it must match "
        "answer_pattern). Empty: the question alone.",
    )
    answer_pattern: str = Field(
        r"<answer>(.*?)</answer>",
        description="Regex whose first group, at its last match in the response, is the answer "
        "builtin:reasoning_gym scores (none: reward 0).",
    )

    @field_validator("answer_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        return checked_pattern(pattern, "answer_pattern", "answer")


def task_names(dataset: str) -> list[str]:
    """The tasks of ``reasoning_gym:A+B``."""
    return dataset[len(PREFIX) :].split("+")


def generator_seed(seed: int) -> int:
    """The reasoning-gym seed of a data seed's rows: its own block of ``ROWS_PER_SEED``, so
    data seeds that differ modulo ``SEED_BLOCKS`` draw no row from the same generator seed."""
    return (seed % SEED_BLOCKS) * ROWS_PER_SEED
