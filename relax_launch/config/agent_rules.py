"""The rules of agentic rollouts' ``rollout.multi_turn`` (``rl/agent_turns.py``): it acts only
with a rollout function, and ``per_turn``'s rows of one conversation (each turn its own context)
are not followed yet by what assembles samples per call or scores them per sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig


def multi_turn_problems(job: JobConfig) -> list[str]:
    """``rollout.multi_turn`` against the rollout function and the algorithm."""
    rollout, a = job.rollout, job.algorithm
    if "multi_turn" in rollout.model_fields_set and not rollout.function:
        return [
            "rollout.multi_turn chooses how rollout.function's conversations are trained; "
            "there is no rollout.function: set one, or remove rollout.multi_turn."
        ]
    if rollout.multi_turn != "per_turn":
        return []
    clashes = {
        "algorithm.max_staleness=0 (its resumable turns record one sequence)": a.max_staleness,
        "no teacher (it scores one sequence per sample)": job.teacher is not None,
        "an advantage_estimator other than gae (its values are per sequence)": (
            a.advantage_estimator == "gae"
        ),
    }
    if needed := [what for what, clash in clashes.items() if clash]:
        return [
            f"rollout.multi_turn=per_turn trains one row per turn, which needs "
            f"{' and '.join(needed)}: change them or use rollout.multi_turn=continue_tokens."
        ]
    return []
