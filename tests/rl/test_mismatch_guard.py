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


# (staleness, logprob_diff_max, mismatch_kl) of healthy bf16 quickstart steps (SmolLM2, CPU)
BF16 = [(0, 0.283, 1.30e-3), (0, 0.203, 1.26e-3), (0, 0.228, 1.27e-3), (0, 0.164, 1.29e-3)]
MIXED = [(0, 0.156, 5.9e-4), (0, 0.762, 7.9e-3), (0, 0.620, 8.1e-3), (0, 0.393, 2.5e-3)]


def test_bfloat16_bounds_the_mean_kl_only_and_float16_has_no_bound_unless_set():
    for dtypes in (("bfloat16", "bfloat16"), ("float32", "bfloat16")):
        bf16 = MismatchGuard.of(MismatchGuardConfig(), *dtypes)
        assert bf16.logprob_diff_max is None  # a max over every token: heavy-tailed in bf16
        assert first_trip(bf16, BF16) is None and first_trip(bf16, MIXED) is None
        step, cause = first_trip(bf16, BROKEN_LORA)
        assert step == 1 and "mismatch_kl 3.44 > 0.1" in cause
    fp16 = MismatchGuard.of(MismatchGuardConfig(), "float16", "float16")
    assert fp16.logprob_diff_max is None and fp16.mismatch_kl is None
    assert first_trip(fp16, BROKEN_LORA) is None  # no measured float16 bound: no guess
    chosen = MismatchGuard.of(MismatchGuardConfig(mismatch_kl=0.5), "float16", "float32")
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


def test_skip_gives_the_trainer_the_bounds_of_the_batch_staleness():
    guard = MismatchGuard.of(MismatchGuardConfig(action="skip"), *FP32)
    assert guard.withhold_above(0) == (("logprob_diff_max", 0.01), ("mismatch_kl", 1e-4))
    assert guard.withhold_above(2) == (("mismatch_kl", 1.0),)  # cause's off-policy bound
    unbounded = MismatchGuard.of(MismatchGuardConfig(action="skip"), "float16", "float16")
    assert unbounded.withhold_above(0) == ()  # no measured float16 bound: nothing withheld
    for action in ("stop", "warn"):  # only skip holds the update back
        assert MismatchGuard.of(MismatchGuardConfig(action=action), *FP32).withhold_above(0) == ()


def withheld(recorded, flags):
    """Recorded rows with the trainer's ``update_withheld`` per step."""
    return [r | {"update_withheld": float(f)} for r, f in zip(rows(recorded), flags, strict=True)]


def test_skip_goes_on_after_a_withheld_step_and_counts_them_in_a_row(caplog):
    guard = MismatchGuard.of(MismatchGuardConfig(action="skip", max_skips=2), *FP32)
    steps = [ON_POLICY_FP32[0], CORRUPTED[0], CORRUPTED[0], ON_POLICY_FP32[1], CORRUPTED[0]]
    with caplog.at_level(logging.WARNING):
        verdicts = [guard.judge(m) for m in withheld(steps, [0, 1, 1, 0, 1])]
    assert verdicts == [None] * 5  # two in a row, then a good step resets the count
    warned = [r.getMessage() for r in caplog.records if "withheld this step" in r.getMessage()]
    assert len(warned) == 3 and "withheld 2 of algorithm.mismatch_guard.max_skips=2" in warned[1]
    assert "withheld 1 of" in warned[2]
    stop = [guard.judge(m) for m in withheld([CORRUPTED[0]] * 2, [1, 1])][-1]
    assert isinstance(stop, MismatchStop) and "3 steps in a row withheld" in str(stop)


def test_skip_stops_a_step_the_trainer_did_update():
    """The trainer's bounds and the guard's are one: a step beyond them that the trainer
    updated anyway is not passed over as withheld."""
    guard = MismatchGuard.of(MismatchGuardConfig(action="skip"), *FP32)
    assert isinstance(guard.judge(withheld([CORRUPTED[0]], [0])[0]), MismatchStop)


def test_a_resumed_run_counts_the_withheld_steps_it_ended_on():
    guard = MismatchGuard.of(MismatchGuardConfig(action="skip", max_skips=2), *FP32)
    guard.resume(withheld([CORRUPTED[0]] * 3, [1, 0, 1]))
    assert guard.withheld_in_a_row == 1
    guard.judge(withheld(CORRUPTED, [1])[0])  # the second in a row: still within max_skips
    assert isinstance(guard.judge(withheld(CORRUPTED, [1])[0]), MismatchStop)
