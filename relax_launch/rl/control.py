"""Closed-loop control of the fully asynchronous schedule (``algorithm.control``, opt-in): the
staleness bound follows what the steps measure. A step whose stale samples' ``mismatch_kl``
(the mean k3 KL(engine || trainer) of the importance ratios) is above ``tighten_above`` lowers
the bound by one (1 at least): the producer then runs at most that many batches ahead, and older
samples are not trained on. ``patience`` steps in a row below ``relax_below`` raise it by one, up
to ``algorithm.max_staleness``. Each change is logged once and every step carries
``control/max_staleness``; ``control/staleness_step`` is -1, 0 or +1.
"""

from __future__ import annotations

from relax_launch.console import operator_log
from relax_launch.rl.config import ControlConfig


class StalenessControl:
    """The staleness bound of a fully asynchronous run, moved by each step's metrics."""

    def __init__(self, config: ControlConfig, ceiling: int) -> None:
        self.config, self.ceiling = config, ceiling
        self.bound = ceiling  # starts where the job put it
        self.calm = 0  # steps in a row below relax_below

    def after_step(self, row: dict[str, float]) -> dict[str, float]:
        """The bound after step ``row`` (its metrics); the control's metrics for the row."""
        change = self._decide(row)
        if change:
            self.bound += change
            verb = "tightened" if change < 0 else "relaxed"
            operator_log().info(
                f"relax-launch: control: max_staleness {verb} to {self.bound} after step "
                f"{int(row['step'])} (mismatch_kl {row['mismatch_kl']:.3g}; algorithm.control)"
            )
        return {"control/max_staleness": float(self.bound), "control/staleness_step": change}

    def _decide(self, row: dict[str, float]) -> int:
        kl = row.get("mismatch_kl")
        if kl is None or row.get("train_skipped"):
            return 0
        if row.get("staleness", 0) > 0 and kl > self.config.tighten_above:
            self.calm = 0
            return -1 if self.bound > 1 else 0
        self.calm = self.calm + 1 if kl < self.config.relax_below else 0
        if self.calm >= self.config.patience and self.bound < self.ceiling:
            self.calm = 0
            return 1
        return 0
