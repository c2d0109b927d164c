"""The files and functions a job's config names, checked before any process starts (by
``relax-launch run``/``sbatch`` and by rank 0 of ``launch.py``): every prompt row is read with
the data's key mapping, and every reward function is imported and must be callable."""

from __future__ import annotations

from dataclasses import dataclass

from relax_launch.config import ConfigError
from relax_launch.rl.agent import load_rollout_function
from relax_launch.rl.code_config import CodeTestsConfig
from relax_launch.rl.code_pool import sandbox_problem, tests_problem
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.data import Prompt, held_out, load_prompts
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.environment_config import EnvironmentConfig
from relax_launch.rl.environment_dataset import EnvironmentProblem, environment_prompts
from relax_launch.rl.reasoning_gym_config import PREFIX, ReasoningGymConfig
from relax_launch.rl.rewards import load_function
from relax_launch.rl.vision_prompts import image_parts, read_images


@dataclass(frozen=True)
class Inputs:
    """The rows ``read_inputs`` read and checked, each file once: the training prompts and the
    eval prompts (none without an ``eval`` section), which rank 0's program takes as read."""

    prompts: list[Prompt]
    eval_prompts: list[Prompt]


def read_inputs(
    data: DataConfig,
    reward: RewardConfig,
    evaluation: EvalConfig | None = None,
    rollout_function: str | None = None,
    environment: EnvironmentConfig | None = None,
    *,
    vision: bool = False,
    decode: bool = True,
) -> Inputs:
    """Raise ConfigError naming the field when the data, the eval data, a reward function or
    the rollout function is unusable; returns the prompts it read (rank 0 trains on the
    training ones and evaluates on the eval ones). ``vision``: the policy is a
    vision-language model, the only one that takes rows with images (each of which must be
    readable). ``decode`` False (the CLI, before rank 0 reads them again): each image's
    header alone (an image, its size), its pixels decoded once, by rank 0."""
    _reasoning_gym_tasks(data, evaluation)
    try:
        prompts = load_prompts(data) if environment is None else environment_prompts(environment)
    except EnvironmentProblem as exc:  # the environment's dataset is the prompts
        raise ConfigError(f"{exc.field}: {exc}", (exc.field,)) from None
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.dataset: {exc}", ("data.dataset",)) from None
    try:
        eval_prompts = load_prompts(evaluation.data) if evaluation is not None else []
    except (ValueError, OSError) as exc:
        raise ConfigError(f"eval.data.dataset: {exc}", ("eval.data.dataset",)) from None
    if evaluation is not None and not held_out(eval_prompts, evaluation.data, prompts, data):
        raise ConfigError(
            f"eval.data.dataset {evaluation.data.dataset}: every prompt is also a training "
            "prompt (the task has few distinct questions): give it a larger task config",
            ("eval.data.dataset",),
        )
    _code_sandboxes(reward, [("data", prompts), ("eval.data", eval_prompts)])
    _image_rows("data", prompts, vision, decode)
    _image_rows("eval.data", eval_prompts, vision, decode)
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
    return Inputs(prompts, eval_prompts)


def _image_rows(field: str, prompts: list[Prompt], vision: bool, decode: bool) -> None:
    """Every image of every row of ``field`` (data, eval.data) opens (a missing file, a remote
    URL, bytes that are not an image, more pixels than ``vision_prompts.MAX_PIXELS``: the row
    and the part named), and only a vision-language policy gets any. These are the only limits
    a dataset image is held to: the controller's requests are not checked again, so a job
    never fails mid-run on an image it accepted here (gateway.images bounds external callers)."""
    for prompt in prompts:
        if not image_parts(prompt.messages):
            continue
        if not vision:
            raise ConfigError(
                f"{field}.dataset: row {prompt.index} has image parts, and trainer.model is not "
                "a vision-language model: train one (builtin:tiny-qwen2.5-vl, a Qwen2.5-VL "
                "directory) or use text rows",
                (f"{field}.dataset", "trainer.model"),
            )
        try:
            read_images(prompt, decode)
        except ValueError as exc:
            raise ConfigError(f"{field}.dataset: {exc}", (f"{field}.dataset",)) from None


def _code_sandboxes(reward: RewardConfig, sections: list[tuple[str, list[Prompt]]]) -> None:
    """Every builtin:code_tests source: its rows carry tests, its uids are its own, and this
    machine can start its sandbox (else the source is refused: it never runs unsandboxed)."""
    taken: dict[int, str] = {}
    for number, source in enumerate(reward.sources):
        if source.function != "builtin:code_tests":
            continue
        field, code = f"reward.sources[{number}].function", source.code or CodeTestsConfig()
        for where, prompts in sections:
            for prompt in prompts:
                if problem := tests_problem((prompt.meta or {}).get("tests")):
                    raise ConfigError(
                        f"{field}: builtin:code_tests: {where}.dataset row {prompt.index} "
                        f"{problem}",
                        (field, f"{where}.dataset"),
                    )
        for uid in range(code.uid, code.uid + code.concurrency):
            if uid in taken:
                where = f"reward.sources[{number}].code.uid"
                raise ConfigError(f"{where}: uid {uid} is also {taken[uid]}'s", (where,))
            taken[uid] = source.name
        if problem := sandbox_problem(code):
            raise ConfigError(f"{field}: builtin:code_tests is refused: {problem}", (field,))


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
