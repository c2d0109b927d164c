"""Config of the closed-loop control (``algorithm.control``, opt-in): one sub-section per
action, each acting on what the steps measure (``rl/control.py``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from relax_launch.config.section import Section


class StalenessControlConfig(Section):
    """The fully asynchronous schedule's staleness bound, moved by the stale samples' mismatch."""

    tighten_above: float = Field(
        0.01,
        gt=0,
        description="A step with stale samples whose mismatch_kl is above this lowers the "
        "bound (max_staleness) by one, to 1 at least.",
    )
    relax_below: float = Field(
        0.002,
        gt=0,
        description="After `patience` steps in a row with mismatch_kl below this, the bound "
        "rises by one, up to algorithm.max_staleness.",
    )
    patience: int = Field(2, ge=1, description="Calm steps before the bound is relaxed.")


class RatioMaskControlConfig(Section):
    """A sequence mask the control engages when a step measures large importance ratios."""

    bound: float = Field(
        2.0,
        gt=1,
        description="A step whose sequence_ratio_max (a sequence's geometric-mean ratio of "
        "trainer over sampling engine, either way: max(r, 1/r)) is above this engages the "
        "mask: from the next step, sequences beyond [1/bound, bound] are not trained on "
        "(control/masked_sequences), with any rollout_correction, none included.",
    )
    release_below: float = Field(
        1.5,
        gt=1,
        description="After `patience` steps in a row with sequence_ratio_max below this (below "
        "bound), the mask is released.",
    )
    patience: int = Field(2, ge=1, description="Calm steps before the mask is released.")

    @model_validator(mode="after")
    def _release_below_bound(self) -> RatioMaskControlConfig:
        if self.release_below >= self.bound:
            raise ValueError(
                f"algorithm.control.ratio_mask.release_below={self.release_below} must be below "
                f"bound={self.bound} (hysteresis): lower it or raise bound"
            )
        return self


class RoutingReplayControlConfig(Section):
    """MoE: routing replay turned on when the trainer's routing drifts from the engine's."""

    routing_mismatch_above: float = Field(
        0.01,
        gt=0,
        description="The rollout engines return the experts they routed to and the trainer "
        "compares its own routing (moe/routing_mismatch) without replaying; the first step "
        "above this turns routing replay on from the next step, for the rest of the run.",
    )


class ControlConfig(Section):
    """Closed-loop control (opt-in): each action set here acts on what the steps measure, each
    change logged once and in the metrics (control/...)."""

    staleness: StalenessControlConfig | None = Field(
        None,
        description="Tighten the staleness bound when the stale samples' mismatch grows, relax "
        "it when it falls (algorithm.max_staleness >= 1 only), in control/max_staleness.",
    )
    ratio_mask: RatioMaskControlConfig | None = Field(
        None,
        description="Drop whole sequences whose importance ratio is beyond a bound while the "
        "steps measure large ratios (every schedule), in control/ratio_mask and "
        "control/masked_sequences.",
    )
    routing_replay: RoutingReplayControlConfig | None = Field(
        None,
        description="MoE with algorithm.routing_replay off: turn replay on once "
        "moe/routing_mismatch exceeds a bound, in control/routing_replay.",
    )

    @model_validator(mode="after")
    def _acts(self) -> ControlConfig:
        if all(getattr(self, action) is None for action in type(self).model_fields):
            raise ValueError(
                "algorithm.control has no action: set staleness, ratio_mask or routing_replay "
                "(e.g. algorithm.control.ratio_mask={}), or remove algorithm.control"
            )
        return self
