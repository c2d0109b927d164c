"""Config section owned by weight sync (trainer -> rollout broadcast)."""

from __future__ import annotations

from pydantic import Field

from relax_launch.config.section import Section


class WeightSyncConfig(Section):
    """How trained weights reach the rollout engines."""

    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Deadline of one whole sync; past it the sync fails and "
        "engines keep serving the previous weight_version.",
    )
