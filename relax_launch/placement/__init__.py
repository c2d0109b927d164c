"""Placement: turn a job config and a world size into a pure rank map (PlacementPlan)."""

from relax_launch.placement.plan import (
    EnginePlan,
    PlacementPlan,
    RankPlan,
    RoleAssignment,
    TrainerLayout,
    WeightSyncGroup,
)
from relax_launch.placement.planner import plan
from relax_launch.placement.preflight import check_runnable, preflight

__all__ = [
    "EnginePlan",
    "PlacementPlan",
    "RankPlan",
    "RoleAssignment",
    "TrainerLayout",
    "WeightSyncGroup",
    "check_runnable",
    "plan",
    "preflight",
]
