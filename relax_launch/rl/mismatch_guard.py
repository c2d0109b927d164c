"""The mismatch guard of every step (``algorithm.mismatch_guard``): the trainer's loss measures
how far the engines that sampled a batch were from the trainer (``logprob_diff_max``, the
largest |trainer - engine| logprob of a trained token; ``mismatch_kl``, the mean k3
KL(engine || trainer)). On-policy, same precision, they are float32 rounding; beyond the bounds
the engines served other weights than the trainer's, and the job stops after the step (the cause
on the last line) or, with ``warn``, says so and counts it.

With ``skip`` the trainer holds the bounds itself (``LossSpec.withhold_above``): the metrics
exist once the batch's forward and backward passes ran, before the optimizer's step, so a batch
beyond them leaves the weights as they were (``update_withheld``). The sync that follows every
step then sends those weights again, and its parity probe checks them; an engine whose weights
were damaged serves the trainer's again. ``max_skips`` such steps in a row stop the job.

Off-policy samples (``staleness`` > 0) differ from the trainer by the updates since they were
sampled as well, so only their importance ratios' KL is bounded, by a looser bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relax_launch.console import operator_log
from relax_launch.rl.config import MismatchGuardConfig

# On-policy bounds when trainer and engines compute in float32: 300x and 100x what the CPU jobs
# measure (logprob_diff_max up to 3.5e-5, mismatch_kl below 1e-6); an engine holding other weights
# shows whole nats (logprob_diff_max 13-18, mismatch_kl 3.4 in issue 50's LoRA job).
FP32_LOGPROB_DIFF_MAX = 1e-2
FP32_MISMATCH_KL = 1e-4
# bfloat16 on either side, measured on the CPU with SmolLM2-135M over 5 steps each: mismatch_kl
# 1.3e-3 to 1.8e-3 (both bf16) and 5.9e-4 to 8.1e-3 (float32 trainer, bf16 engines), 34x below
# the broken LoRA's 3.4. logprob_diff_max (0.16-0.76 there) is a maximum over every trained
# token, heavy-tailed in bf16 and growing with the batch: no default bound.
BF16_MISMATCH_KL = 0.1


class MismatchStop(RuntimeError):  # noqa: N818 - the job's end, named for what it does
    """The guard ended the job; its message, one line (the job's last line carries an error's
    first), starts with the cause."""


@dataclass
class MismatchGuard:
    """The bounds of one job (None: no bound), what a step beyond them does, and (``skip``)
    how many steps in a row had their update withheld."""

    action: str
    logprob_diff_max: float | None
    mismatch_kl: float | None
    off_policy_mismatch_kl: float | None
    max_skips: int = 2
    withheld_in_a_row: int = field(default=0, init=False)

    @classmethod
    def of(
        cls, config: MismatchGuardConfig, trainer_dtype: str, engine_dtype: str
    ) -> MismatchGuard | None:
        """The job's guard, its unset on-policy bounds resolved for the precisions in use
        (measured float32 and bfloat16 bounds; none for float16); None when off."""
        if config.action == "off":
            return None
        fp32 = trainer_dtype == engine_dtype == "float32"
        bf16 = not fp32 and {trainer_dtype, engine_dtype} <= {"float32", "bfloat16"}
        diff = config.logprob_diff_max or (FP32_LOGPROB_DIFF_MAX if fp32 else None)
        measured_kl = FP32_MISMATCH_KL if fp32 else BF16_MISMATCH_KL if bf16 else None
        kl = config.mismatch_kl or measured_kl
        return cls(config.action, diff, kl, config.off_policy_mismatch_kl, config.max_skips)

    def resume(self, history: list[dict[str, float]]) -> None:
        """The withheld steps in a row that a resumed run's last steps ended on."""
        for row in history:
            self.withheld_in_a_row = self.withheld_in_a_row + 1 if row.get("update_withheld") else 0

    def withhold_above(self, staleness: int) -> tuple[tuple[str, float], ...]:
        """The bounds the trainer holds a batch to before it updates (``skip`` only), for a
        batch whose oldest sample is ``staleness`` versions old: the same as ``cause``'s."""
        if self.action != "skip":
            return ()
        if staleness > 0:
            bounds = {"mismatch_kl": self.off_policy_mismatch_kl}
        else:
            bounds = {"logprob_diff_max": self.logprob_diff_max, "mismatch_kl": self.mismatch_kl}
        return tuple((name, bound) for name, bound in bounds.items() if bound is not None)

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
        """Counts the step in ``guard/tripped``; beyond the bounds, warns (``warn``, or a
        withheld update under ``skip``) or returns the error that stops the job (raised once the
        step's metrics are written)."""
        cause = self.cause(metrics)
        metrics["guard/tripped"] = float(cause is not None)
        if cause is None:
            self.withheld_in_a_row = 0
            return None
        if self.action == "warn":
            operator_log().warning(f"relax-launch: mismatch guard: {cause}")
            return None
        if self.action == "skip" and metrics.get("update_withheld"):
            self.withheld_in_a_row += 1
            if self.withheld_in_a_row <= self.max_skips:
                operator_log().warning(
                    f"relax-launch: mismatch guard: {cause}; the trainer withheld this step's "
                    "update and the sync after it sent the weights again (withheld "
                    f"{self.withheld_in_a_row} of algorithm.mismatch_guard.max_skips="
                    f"{self.max_skips} in a row)"
                )
                return None
            return MismatchStop(
                f"mismatch guard: {cause}; {self.withheld_in_a_row} steps in a row withheld "
                f"(algorithm.mismatch_guard.max_skips={self.max_skips}): sending the weights "
                "again did not bring the engines back to the trainer's; the job stops"
            )
        return MismatchStop(
            f"mismatch guard: {cause}; the job stops after this step (algorithm.mismatch_guard"
            ".action=stop; skip withholds the update and syncs again, warn goes on): the "
            "engines likely hold other weights than the trainer (a LoRA merge, a tensor's "
            "layout, a dtype): see the syncs' parity probe (sync/parity_gap)"
        )
