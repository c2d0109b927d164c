"""The value model on ranks of its own (``critic.ranks: own``, decoupled placement): a grid of
``critic.tp_size`` x ``critic.dp_size`` ranks of one pipeline stage, right after the trainer's
and before the inference roles'. Pure arithmetic, like the planner; every rejection names the
fields at fault."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_launch.config.errors import ConfigError
from relax_launch.placement.plan import RoleAssignment, TrainerLayout

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

ROLE = "critic"


def critic_rank_count(job: JobConfig) -> int:
    """How many ranks the value model has of its own (0: none, it shares the trainer's)."""
    critic = job.critic
    if critic is None or not critic.own_ranks or job.placement.mode != "decoupled":
        return 0
    tp, dp = critic.own_layout(job.trainer)
    return tp * dp


def critic_layout(job: JobConfig, per_node: int) -> TrainerLayout | None:
    """The value model's grid on its own ranks (None: it has none), which follow the trainer's;
    its tensor-parallel groups stay within a node."""
    count = critic_rank_count(job)
    if not count:
        return None
    tp, dp = job.critic.own_layout(job.trainer)
    first = job.trainer.ranks
    for start in range(first, first + count, tp):
        if start // per_node != (start + tp - 1) // per_node:
            raise ConfigError(
                f"critic.tp_size={tp} would make the critic's tensor-parallel group on ranks "
                f"{start}-{start + tp - 1} cross a node boundary ({per_node} ranks per node; "
                f"the critic's ranks follow trainer.ranks={first}): choose trainer.ranks and "
                "critic.tp_size so that each group of the critic fits in one node.",
                ("critic.tp_size", "trainer.ranks"),
            )
    return TrainerLayout(
        ranks=tuple(range(first, first + count)),
        tp_size=tp,
        pp_size=1,
        dp_size=dp,
        phase="resident",
    )


def critic_assignment(layout: TrainerLayout, rank: int) -> RoleAssignment:
    """The critic's role on one of its ranks: its grid coordinates."""
    tp, dp, pp = layout.coordinates(rank)
    return RoleAssignment(role=ROLE, phase=layout.phase, tp_rank=tp, pp_rank=pp, dp_rank=dp)
