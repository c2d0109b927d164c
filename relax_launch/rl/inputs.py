"""The files and functions a job's config names, checked before any process starts (by
``relax-launch run``/``sbatch`` and by rank 0 of ``launch.py``): every prompt row is read with
the data's key mapping, and every reward function is imported and must be callable."""

from __future__ import annotations

from relax_launch.config import ConfigError
from relax_launch.rl.agent import load_rollout_function
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.data import Prompt, load_prompts
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.reasoning_gym_config import PREFIX, ReasoningGymConfig
from relax_launch.rl.rewards import load_function


def check_inputs(
    data: DataConfig,
    reward: RewardConfig,
    evaluation: EvalConfig | None = None,
    rollout_function: str | None = None,
) -> list[Prompt]:
    """Raise ConfigError naming the field when the data, the eval data, a reward function or
    the rollout function is unusable; returns the training prompts (rank 0 trains on them)."""
    _reasoning_gym_tasks(data, evaluation)
    try:
        prompts = load_prompts(data)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.dataset: {exc}", ("data.dataset",)) from None
    try:
        if evaluation is not None:
            load_prompts(evaluation.data)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"eval.data.dataset: {exc}", ("eval.data.dataset",)) from None
    for number, source in enumerate(reward.sources):
        if source.function is None:
            continue
        field = f"reward.sources[{number}].function"
        if source.function == "builtin:reasoning_gym":
            _reasoning_gym_rows(field, data, evaluation)
        try:
            function = load_function(source.function)
        except ValueError as exc:
            raise ConfigError(f"{field}: {exc}; is its module on PYTHONPATH?", (field,)) from None
        if not callable(function):
            raise ConfigError(f"{field}={source.function!r} is not a function", (field,))
    if rollout_function is not None:
        try:
            load_rollout_function(rollout_function)
        except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
            raise ConfigError(
                f"rollout.function: {exc} ({type(exc).__name__}); is its module on PYTHONPATH?",
                ("rollout.function",),
            ) from None
    return prompts


def _reasoning_gym_rows(field: str, data: DataConfig, evaluation: EvalConfig | None) -> None:
    """builtin:reasoning_gym scores only rows that carry a reasoning-gym entry."""
    sections = [("data", data)] + ([("eval.data", evaluation.data)] if evaluation else [])
    for where, section in sections:
        if not section.dataset.startswith(PREFIX):
            raise ConfigError(
                f"{field}: builtin:reasoning_gym scores rows of reasoning_gym:TASK datasets; "
                f"{where}.dataset is {section.dataset}",
                (field, f"{where}.dataset"),
            )


def _reasoning_gym_tasks(data: DataConfig, evaluation: EvalConfig | None) -> None:
    """Every task of a ``reasoning_gym:A+B`` dataset exists and takes its configured settings."""
    sections = [("data", data)] + ([("eval.data", evaluation.data)] if evaluation else [])
    for where, section in sections:
        if not section.dataset.startswith(PREFIX):
            continue
        from relax_launch.rl.reasoning_gym_tasks import task_problems  # reasoning-gym: seconds

        chosen = section.reasoning_gym or ReasoningGymConfig()
        if problems := task_problems(section.dataset, chosen):
            raise ConfigError(
                f"{where}.dataset {section.dataset}: " + "; ".join(problems), (f"{where}.dataset",)
            )
