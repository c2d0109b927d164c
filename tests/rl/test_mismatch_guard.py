"""The mismatch guard (``rl/mismatch_guard.py``) on recorded metric sequences: the steps of real
CPU jobs pass, issue 50's LoRA job with an engine serving other weights stops at its first step
with the cause on the last line, and the run writes the step before it ends."""

from __future__ import annotations

import json
import logging

import pytest
from test_rl_schedule import context

from relax_launch.rl.config import MismatchGuardConfig
from relax_launch.rl.context import StepResult
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.mismatch_guard import MismatchGuard, MismatchStop
from relax_launch.rl.runner import run

FP32 = ("float32", "float32")
# Recorded: (staleness, logprob_diff_max, mismatch_kl) per step of real jobs.
ON_POLICY_FP32 = [(0, 2.4e-5, 0.0), (0, 3.2e-5, 0.0), (0, 2.2e-5, 0.0)]  # quickstart, 3 steps
OFF_POLICY_LR_1E2 = [(0, 0.0, 0.0), (1, 0.43, 0.017), (1, 0.81, 0.026)]  # test_off_policy_job
FULLY_ASYNC = [(0, 0.0, 0.0), (1, 0.045, 1.5e-4), (2, 0.54, 0.023), (1, 1.37, 0.13)]
BROKEN_LORA = [(0, 16.5, 3.44), (0, 17.9, 3.50), (0, 13.7, 3.47)]  # issue 50, split + LoRA
CORRUPTED = [(0, 0.152, 4.4e-4)]  # test_parity_probe_job's engine with the probe off


def rows(recorded: list[tuple[int, float, float]]) -> list[dict[str, float]]:
    return [
        {"step": i + 1, "reward": 0.5, "tokens_per_s": 1.0}
        | {"staleness": s, "logprob_diff_max": d, "mismatch_kl": k}
        for i, (s, d, k) in enumerate(recorded)
    ]


def first_trip(guard: MismatchGuard, recorded) -> tuple[int, str] | None:
    for metrics in rows(recorded):
        if (cause := guard.cause(metrics)) is not None:
            return metrics["step"], cause
    return None


def test_real_jobs_pass_and_the_broken_lora_job_trips_at_step_1():
    guard = MismatchGuard.of(MismatchGuardConfig(), *FP32)
    for recorded in (ON_POLICY_FP32, OFF_POLICY_LR_1E2, FULLY_ASYNC):
        assert first_trip(guard, recorded) is None
    step, cause = first_trip(guard, BROKEN_LORA)
    assert step == 1 and "on-policy step 1: logprob_diff_max 16.5 > 0.01" in cause
    step, cause = first_trip(guard, CORRUPTED)  # one matrix off by noise: caught as well
    assert step == 1 and "logprob_diff_max 0.152 > 0.01" in cause


def test_stale_samples_are_bounded_by_their_importance_ratios_only():
    guard = MismatchGuard.of(MismatchGuardConfig(), *FP32)
    # a stale step's logprob_diff_max is the policy's own drift: not a mismatch
    assert guard.cause(rows([(1, 5.0, 0.2)])[0]) is None
    broken_async = [(0, 0.0, 0.0), (1, 14.0, 3.4)]
    step, cause = first_trip(guard, broken_async)
    assert step == 2 and "mismatch_kl 3.4 > 1" in cause and "1 versions stale" in cause
    unbounded = MismatchGuard.of(MismatchGuardConfig(off_policy_mismatch_kl=None), *FP32)
    assert first_trip(unbounded, broken_async) is None


def test_other_precisions_have_no_on_policy_bound_unless_set():
    bf16 = MismatchGuard.of(MismatchGuardConfig(), "bfloat16", "bfloat16")
    assert bf16.logprob_diff_max is None and bf16.mismatch_kl is None
    assert first_trip(bf16, BROKEN_LORA) is None  # no measured bf16 bound: no guess
    chosen = MismatchGuard.of(MismatchGuardConfig(mismatch_kl=0.5), "bfloat16", "float32")
    assert first_trip(chosen, BROKEN_LORA)[0] == 1
    assert MismatchGuard.of(MismatchGuardConfig(action="off"), *FP32) is None


def test_a_step_that_trained_nothing_is_not_judged():
    guard = MismatchGuard.of(MismatchGuardConfig(), *FP32)
    assert guard.cause({"step": 1, "train_skipped": 1, "mismatch_kl": 9.0}) is None
    assert guard.cause({"step": 1, "train_skipped": 1}) is None


class Recorded:
    """A schedule replaying recorded step metrics."""

    def __init__(self, recorded) -> None:
        self.rows = rows(recorded)

    def step(self, step: int) -> StepResult:
        return StepResult(dict(self.rows[step]), PromptCursor(seen=step + 1), {"train": 0.1})

    def close(self) -> None:
        pass


def test_stop_writes_the_step_then_ends_with_the_cause(tmp_path):
    ctx = context(tmp_path)
    ctx = type(ctx)(**{**ctx.__dict__, "guard": MismatchGuard.of(MismatchGuardConfig(), *FP32)})
    with pytest.raises(MismatchStop) as stopped:
        run(ctx, Recorded(BROKEN_LORA), 3, tmp_path)
    # one line: the job's last line ("job failed: ...") carries an error's first line
    (line,) = str(stopped.value).splitlines()
    assert line.startswith("mismatch guard: on-policy step 1: logprob_diff_max 16.5 > 0.01")
    written = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(w["step"], w["guard/tripped"]) for w in written] == [(1, 1.0)]


def test_warn_logs_each_trip_counts_it_and_goes_on(tmp_path, caplog):
    ctx = context(tmp_path)
    guard = MismatchGuard.of(MismatchGuardConfig(action="warn"), *FP32)
    ctx = type(ctx)(**{**ctx.__dict__, "guard": guard})
    recorded = [ON_POLICY_FP32[0], BROKEN_LORA[1], ON_POLICY_FP32[1]]
    with caplog.at_level(logging.WARNING):
        history = run(ctx, Recorded(recorded), 3, tmp_path)
    assert [h["guard/tripped"] for h in history] == [0.0, 1.0, 0.0]
    warned = [r.getMessage() for r in caplog.records if "mismatch guard" in r.getMessage()]
    assert len(warned) == 1 and "on-policy step 2" in warned[0]
