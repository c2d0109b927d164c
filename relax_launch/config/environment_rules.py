"""The rules of a job with an environment (``rollout.environment``, ``rl/environments.py``): the
environment supplies the prompts and the reward, so what would be ignored beside it is refused
naming the field."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

RUBRIC = "builtin:environment"


def environment_problems(job: JobConfig) -> list[str]:
    """The environment against the data, the rewards and the other rollout options."""
    uses_rubric = any(s.function == RUBRIC for s in job.reward.sources)
    if job.rollout.environment is None:
        if uses_rubric:
            return [f"reward source {RUBRIC} is rollout.environment's rubric: set that section."]
        return []
    problems = []
    if job.rollout.function is not None:
        problems.append(
            "rollout.environment holds the conversations itself: remove rollout.function."
        )
    if "dataset" in job.data.model_fields_set:
        problems.append(
            "rollout.environment's dataset is the prompts: remove data.dataset (data.seed "
            "still shuffles them)."
        )
    if not uses_rubric:
        problems.append(
            "rollout.environment's rubric is the reward: add {name: rubric, function: "
            f"{RUBRIC}}} to reward.sources."
        )
    if job.eval is not None:
        problems.append(
            "eval samples eval.data without the environment's rollout and rubric (not built "
            "for environments yet): remove the eval section."
        )
    if job.algorithm.max_staleness:
        problems.append(
            "algorithm.max_staleness (fully asynchronous) is not built for environments yet: "
            "set it to 0 (algorithm.off_policy_steps: 1 overlaps rollout and training)."
        )
    if job.algorithm.records_routing:
        problems.append(
            "algorithm.routing_replay records the experts of each generate call; an "
            "environment's samples are assembled from several calls: turn it off."
        )
    return problems
