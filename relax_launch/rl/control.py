"""Closed-loop control (``algorithm.control``, opt-in): actions on what each step measures, each
change logged once on the console, the state in every step's metrics. The decisions are pure
functions of the recorded metrics (``next_bound``, ``next_mask``, ``replay_due``), unit-tested
on recorded sequences.

- ``staleness`` (the fully asynchronous schedule, ``StalenessControl``): a step whose stale
  samples' ``mismatch_kl`` (the mean k3 KL(engine || trainer) of the importance ratios) is above
  ``tighten_above`` lowers the bound by one (1 at least): the producer then runs at most that
  many batches ahead, and older samples are not trained on. ``patience`` steps in a row below
  ``relax_below`` raise it by one, up to ``algorithm.max_staleness``. Metrics
  ``control/max_staleness``, ``control/staleness_step`` (-1, 0, +1).
- ``ratio_mask`` (every schedule, ``StepControl``): a step whose ``sequence_ratio_max`` (the
  largest geometric-mean ratio of trainer over sampling engine of a sequence, either way;
  ``trainer/sequence_mask.py``) is above ``bound`` engages a mask: from the next step the
  trainer drops every sequence beyond [1/bound, bound] from the loss. ``patience`` steps in a
  row below ``release_below`` release it. Metrics ``control/ratio_mask`` (1: the next step
  masks), ``control/ratio_mask_step`` (+1 engaged, -1 released), ``control/masked_sequences``
  (the share of this step's sequences dropped).
- ``routing_replay`` (MoE, every schedule where replay works): the engines return their routing
  and the trainer compares its own (``moe/routing_mismatch``) without replaying; the first step
  above ``routing_mismatch_above`` turns replay on from the next step, for the rest of the run
  (the routing is in every batch already). Metric ``control/routing_replay``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from relax_launch.console import operator_log
from relax_launch.rl.control_config import (
    ControlConfig,
    RatioMaskControlConfig,
    RoutingReplayControlConfig,
    StalenessControlConfig,
)
from relax_launch.trainer.losses import LossSpec


def measured(row: dict[str, float], name: str) -> float | None:
    """The step's ``name``; None when the step trained on nothing (no measurement)."""
    return None if row.get("train_skipped") else row.get(name)


@dataclass(frozen=True)
class Latch:
    """An action that engages and releases: whether it is on, and the calm steps counted."""

    on: bool = False
    calm: int = 0


def next_bound(
    config: StalenessControlConfig, bound: int, calm: int, ceiling: int, row: dict[str, float]
) -> tuple[int, int]:
    """The staleness bound and calm steps after step ``row``."""
    kl = measured(row, "mismatch_kl")
    if kl is None:
        return bound, calm
    if row.get("staleness", 0) > 0 and kl > config.tighten_above:
        return max(bound - 1, 1), 0
    calm = calm + 1 if kl < config.relax_below else 0
    if calm >= config.patience and bound < ceiling:
        return bound + 1, 0
    return bound, calm


def next_mask(config: RatioMaskControlConfig, state: Latch, row: dict[str, float]) -> Latch:
    """The sequence mask after step ``row``: engaged by a ratio above the bound, released after
    ``patience`` steps in a row below ``release_below``."""
    ratio = measured(row, "sequence_ratio_max")
    if ratio is None:
        return state
    if ratio > config.bound:
        return Latch(on=True)
    if not state.on:
        return state
    calm = state.calm + 1 if ratio < config.release_below else 0
    return Latch() if calm >= config.patience else Latch(on=True, calm=calm)


def replay_due(config: RoutingReplayControlConfig, on: bool, row: dict[str, float]) -> bool:
    """Whether the trainer replays the engine's routing from the step after ``row`` on."""
    mismatch = measured(row, "moe/routing_mismatch")
    return on or (mismatch is not None and mismatch > config.routing_mismatch_above)


class StalenessControl:
    """The staleness bound of a fully asynchronous run, moved by each step's metrics."""

    def __init__(self, config: StalenessControlConfig, ceiling: int) -> None:
        self.config, self.ceiling = config, ceiling
        self.bound = ceiling  # starts where the job put it
        self.calm = 0  # steps in a row below relax_below

    def after_step(self, row: dict[str, float]) -> dict[str, float]:
        """The bound after step ``row`` (its metrics); the control's metrics for the row."""
        before = self.bound
        self.bound, self.calm = next_bound(self.config, before, self.calm, self.ceiling, row)
        change = self.bound - before
        if change:
            verb = "tightened" if change < 0 else "relaxed"
            operator_log().info(
                f"relax-launch: control: max_staleness {verb} to {self.bound} after step "
                f"{int(row['step'])} (mismatch_kl {row['mismatch_kl']:.3g}; "
                "algorithm.control.staleness)"
            )
        return {"control/max_staleness": float(self.bound), "control/staleness_step": change}

    def resume(self, history: list[dict[str, float]]) -> None:
        """Where the steps of a resumed run left the bound (the decisions replayed, quietly)."""
        for row in history:
            self.bound, self.calm = next_bound(
                self.config, self.bound, self.calm, self.ceiling, row
            )


class StepControl:
    """The actions on the train step of every schedule: what the next step's loss spec asks of
    the trainer (the sequence mask, routing replay), decided after each step."""

    def __init__(self, config: ControlConfig) -> None:
        self.mask_config, self.replay_config = config.ratio_mask, config.routing_replay
        self.mask = Latch()
        self.replaying = False

    @classmethod
    def of(cls, config: ControlConfig | None) -> StepControl | None:
        """The job's step control; None when no action of it is set."""
        if config is None or (config.ratio_mask is None and config.routing_replay is None):
            return None
        return cls(config)

    def resume(self, history: list[dict[str, float]]) -> None:
        """Where the steps of a resumed run left the mask and the replay (the decisions
        replayed, quietly)."""
        for row in history:
            if self.mask_config is not None:
                self.mask = next_mask(self.mask_config, self.mask, row)
            if self.replay_config is not None:
                self.replaying = replay_due(self.replay_config, self.replaying, row)

    def loss_spec(self, spec: LossSpec) -> LossSpec:
        """``spec`` with the control's settings for the next train step."""
        changes = {}
        if self.mask_config is not None and self.mask.on:
            changes["sequence_ratio_bound"] = self.mask_config.bound
        if self.replay_config is not None:
            changes["routing_replay"] = self.replaying
        return dataclasses.replace(spec, **changes)

    def after_step(self, row: dict[str, float]) -> dict[str, float]:
        """Decide the next step's settings from step ``row``; the control's metrics for it."""
        out: dict[str, float] = {}
        if self.mask_config is not None:
            out |= self._move_mask(self.mask_config, row)
        if self.replay_config is not None:
            was, self.replaying = (
                self.replaying,
                replay_due(self.replay_config, self.replaying, row),
            )
            if self.replaying and not was:
                operator_log().info(
                    f"relax-launch: control: routing replay turned on after step "
                    f"{int(row['step'])} (moe/routing_mismatch {row['moe/routing_mismatch']:.3g} "
                    f"> {self.replay_config.routing_mismatch_above:g}; algorithm.control."
                    "routing_replay): the trainer computes each token with the engine's experts"
                )
            out["control/routing_replay"] = float(self.replaying)
        return out

    def _move_mask(self, config: RatioMaskControlConfig, row: dict[str, float]) -> dict[str, float]:
        was, self.mask = self.mask.on, next_mask(config, self.mask, row)
        change = int(self.mask.on) - int(was)
        if change:
            step, ratio = int(row["step"]), row["sequence_ratio_max"]
            what = (
                f"engaged (sequence_ratio_max {ratio:.3g} > {config.bound:g}): sequences beyond "
                f"[{1 / config.bound:.3g}, {config.bound:g}] are not trained on"
                if change > 0
                else f"released (sequence_ratio_max below {config.release_below:g} for "
                f"{config.patience} steps)"
            )
            operator_log().info(
                f"relax-launch: control: sequence ratio mask {what} from step {step + 1} "
                "(algorithm.control.ratio_mask)"
            )
        return {
            "control/ratio_mask": float(self.mask.on),
            "control/ratio_mask_step": float(change),
            "control/masked_sequences": row.get("control/masked_sequences", 0.0),
        }
