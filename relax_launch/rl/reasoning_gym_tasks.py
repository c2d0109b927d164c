"""reasoning-gym tasks as prompts (``data.dataset: reasoning_gym:TASK[+TASK...]``) and their
scoring with each task's own ``score_answer`` (the ``builtin:reasoning_gym`` reward, run in a
scoring worker). The generators are procedural and seeded: nothing is downloaded.

A row is the task's question followed by ``answer_format`` (how to state the answer), labelled
with the task's answer; its data_source is the task's name and its ``meta`` carries the task's
entry (question, answer, metadata) and ``answer_pattern``, so the reward scores the row the
way its prompt asked, whichever config it came from."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS

from relax_launch.config.patterns import last_group
from relax_launch.rl.reasoning_gym_config import ReasoningGymConfig, generator_seed, task_names


@functools.cache
def known_tasks() -> tuple[str, ...]:
    """Every task reasoning-gym can generate (``composite`` is the combination ``+`` makes)."""
    return tuple(sorted(name for name in DATASETS if name != "composite"))


def config_problem(task: str, kwargs: dict[str, Any]) -> str | None:
    """Why the task's own config refuses ``kwargs`` (an unknown field, a value out of range),
    or None when it accepts them."""
    config_class = DATASETS[task][1]
    try:
        config = config_class(**kwargs)
        if hasattr(config, "validate"):
            config.validate()
    except (TypeError, ValueError, AssertionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def rows(
    tasks: list[str],
    size: int,
    seed: int,
    task_config: dict[str, dict[str, Any]],
    answer_format: str,
    answer_pattern: str,
) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(prompt text, label, task, meta) of ``size`` entries of each task, from ``seed``'s own
    generator seeds (``generator_seed``: another data seed shares none of its rows' seeds)."""
    out = []
    for task in tasks:
        dataset = reasoning_gym.create_dataset(
            task, size=size, seed=generator_seed(seed), **task_config.get(task, {})
        )
        for entry in dataset:
            text = f"{entry['question']}\n\n{answer_format}" if answer_format else entry["question"]
            meta = {"entry": entry, "answer_pattern": answer_pattern}
            out.append((text, str(entry["answer"]), task, meta))
    return out


def extract(response: str, pattern: str) -> str | None:
    """The last match's first group, stripped; None when the response has none."""
    found = last_group(response, pattern)
    return found.strip() if found is not None else None


@functools.cache
def scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    return reasoning_gym.get_score_answer_fn(task)


def score(response: str, task: str, meta: dict[str, Any] | None) -> float:
    """The task's ``score_answer`` of the answer the response states (0.0 when it states
    none); ValueError for a row that is not a reasoning-gym row."""
    if not meta or "entry" not in meta or task not in DATASETS:
        raise ValueError(
            f"builtin:reasoning_gym scores rows of data.dataset: reasoning_gym:...; this "
            f"sample's row (data_source {task!r}) is not one"
        )
    answer = extract(response, meta["answer_pattern"])
    if answer is None:
        return 0.0
    return float(scorer(task)(answer, meta["entry"]))


def task_problems(dataset: str, section: ReasoningGymConfig) -> list[str]:
    """What is wrong with the tasks of ``reasoning_gym:A+B`` and their configs (empty: fine)."""
    known = known_tasks()
    names = task_names(dataset)
    problems = []
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=4, cutoff=0.5) or list(known[:4])
            problems.append(
                f"unknown reasoning-gym task {name!r}; close names: {', '.join(close)} "
                f"({len(known)} tasks: python -c 'import reasoning_gym; "
                "print(sorted(reasoning_gym.factory.DATASETS))')"
            )
    for name, kwargs in section.tasks.items():
        if name not in names:
            problems.append(f"reasoning_gym.tasks.{name} configures a task {dataset} does not draw")
        elif problem := config_problem(name, kwargs):
            problems.append(f"reasoning_gym.tasks.{name}: {problem}")
    return problems
