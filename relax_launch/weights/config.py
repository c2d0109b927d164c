"""Config section owned by weight sync (trainer -> rollout broadcast)."""

from __future__ import annotations

from pydantic import Field

from relax_launch.config.section import Section


class WeightSyncConfig(Section):
    """How trained weights reach the rollout engines."""

    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Deadline of one send of the weights to every engine; past it the send "
        "fails, the engines stay out of routing and the same version is sent once more (a "
        "second failure ends the job).",
    )
