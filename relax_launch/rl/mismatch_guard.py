"""The mismatch guard of every step (``algorithm.mismatch_guard``): the trainer's loss measures
how far the engines that sampled a batch were from the trainer (``logprob_diff_max``, the
largest |trainer - engine| logprob of a trained token; ``mismatch_kl``, the mean k3
KL(engine || trainer)). On-policy, same precision, they are float32 rounding; beyond the bounds
the engines served other weights than the trainer's, and the job stops after the step (the cause
on the last line) or, with ``warn``, says so and counts it.

Off-policy samples (``staleness`` > 0) differ from the trainer by the updates since they were
sampled as well, so only their importance ratios' KL is bounded, by a looser bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_launch.console import operator_log
from relax_launch.rl.config import MismatchGuardConfig

# On-policy bounds when trainer and engines compute in float32: 300x and 100x what the CPU jobs
# measure (logprob_diff_max up to 3.5e-5, mismatch_kl below 1e-6); an engine holding other weights
# shows whole nats (logprob_diff_max 13-18, mismatch_kl 3.4 in issue 50's LoRA job).
FP32_LOGPROB_DIFF_MAX = 1e-2
FP32_MISMATCH_KL = 1e-4


class MismatchStop(RuntimeError):  # noqa: N818 - the job's end, named for what it does
    """The guard ended the job; its message, one line (the job's last line carries an error's
    first), starts with the cause."""


@dataclass(frozen=True)
class MismatchGuard:
    """The bounds of one job (None: no bound) and what a step beyond them does."""

    action: str
    logprob_diff_max: float | None
    mismatch_kl: float | None
    off_policy_mismatch_kl: float | None

    @classmethod
    def of(
        cls, config: MismatchGuardConfig, trainer_dtype: str, engine_dtype: str
    ) -> MismatchGuard | None:
        """The job's guard, its unset on-policy bounds resolved for the precisions in use
        (measured float32 bounds; none for other precisions); None when off."""
        if config.action == "off":
            return None
        fp32 = trainer_dtype == engine_dtype == "float32"
        diff = config.logprob_diff_max or (FP32_LOGPROB_DIFF_MAX if fp32 else None)
        kl = config.mismatch_kl or (FP32_MISMATCH_KL if fp32 else None)
        return cls(config.action, diff, kl, config.off_policy_mismatch_kl)

    def cause(self, metrics: dict[str, float]) -> str | None:
        """Why the step's samples are beyond the bounds (None: within them, or not trained)."""
        if metrics.get("train_skipped") or "mismatch_kl" not in metrics:
            return None
        step, kl = metrics.get("step"), metrics["mismatch_kl"]
        if metrics.get("staleness", 0) > 0:
            bound = self.off_policy_mismatch_kl
            if bound is not None and not kl <= bound:
                return (
                    f"step {step} (samples up to {metrics['staleness']} versions stale): "
                    f"mismatch_kl {kl:.3g} > {bound:g} (algorithm.mismatch_guard."
                    "off_policy_mismatch_kl): the importance ratios say the engines sampled "
                    "from a policy far from the trainer's"
                )
            return None
        diff = metrics.get("logprob_diff_max", 0.0)
        for name, value, bound in (
            ("logprob_diff_max", diff, self.logprob_diff_max),
            ("mismatch_kl", kl, self.mismatch_kl),
        ):
            if bound is not None and not value <= bound:
                return (
                    f"on-policy step {step}: {name} {value:.3g} > {bound:g} (algorithm."
                    f"mismatch_guard.{name}): the rollout engines scored the samples away from "
                    "the trainer with the same weights version"
                )
        return None

    def judge(self, metrics: dict[str, float]) -> MismatchStop | None:
        """Counts the step in ``guard/tripped``; beyond the bounds, warns or returns the error
        that stops the job (raised once the step's metrics are written)."""
        cause = self.cause(metrics)
        metrics["guard/tripped"] = float(cause is not None)
        if cause is None:
            return None
        if self.action == "warn":
            operator_log().warning(f"relax-launch: mismatch guard: {cause}")
            return None
        return MismatchStop(
            f"mismatch guard: {cause}; the job stops after this step (algorithm.mismatch_guard"
            ".action=stop; warn goes on): the engines likely hold other weights than the "
            "trainer (a LoRA merge, a tensor's layout, a dtype): see the syncs' parity probe "
            "(sync/parity_gap)"
        )
