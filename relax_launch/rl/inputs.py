"""The files and functions a job's config names, checked before any process starts (by
``relax-launch run``/``sbatch`` and by rank 0 of ``launch.py``): every prompt row is read with
the data's key mapping, and every reward function is imported and must be callable."""

from __future__ import annotations

from relax_launch.config import ConfigError
from relax_launch.rl.config import DataConfig, RewardConfig
from relax_launch.rl.data import load_prompts
from relax_launch.rl.rewards import load_function


def check_inputs(data: DataConfig, reward: RewardConfig) -> int:
    """Raise ConfigError naming the field when the data or a reward function is unusable;
    returns the number of prompts."""
    try:
        prompts = load_prompts(data)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.dataset: {exc}", ("data.dataset",)) from None
    for number, source in enumerate(reward.sources):
        if source.function is None:
            continue
        field = f"reward.sources[{number}].function"
        try:
            function = load_function(source.function)
        except ValueError as exc:
            raise ConfigError(f"{field}: {exc}; is its module on PYTHONPATH?", (field,)) from None
        if not callable(function):
            raise ConfigError(f"{field}={source.function!r} is not a function", (field,))
    return len(prompts)
