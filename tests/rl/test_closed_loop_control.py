"""Closed-loop control of the staleness bound (``rl/control.py``) on recorded metric sequences
of real fully asynchronous jobs: tightened when the stale samples' mismatch grows, relaxed after
calm steps, never below 1 or above max_staleness, each change logged once. The real job whose
bound moves: ``test_control_job.py`` (slow)."""

from __future__ import annotations

import logging

import pytest

from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.control import StalenessControl
from relax_launch.rl.control_config import StalenessControlConfig

# (staleness, mismatch_kl) per step: tests/rl/test_async_job.py's job at lr 1e-3, max_staleness 2
ASYNC_TINY = [(0, 0.0), (1, 0.0031), (2, 0.0058), (2, 0.0013), (2, 0.0011), (2, 0.0020)]
# constructed (no recorded run drifts this far): stale samples whose mismatch grows, then falls
DRIFTING = [(0, 0.0), (1, 0.004), (2, 0.02), (1, 0.03), (1, 0.012), (1, 0.001), (1, 0.0008)]


def replay(control: StalenessControl, recorded) -> list[tuple[float, float]]:
    rows = [{"step": i + 1, "staleness": s, "mismatch_kl": k} for i, (s, k) in enumerate(recorded)]
    return [
        (m["control/max_staleness"], m["control/staleness_step"])
        for m in map(control.after_step, rows)
    ]


def test_the_default_bounds_leave_a_healthy_async_run_alone():
    assert {b for b, _ in replay(StalenessControl(StalenessControlConfig(), 2), ASYNC_TINY)} == {
        2.0
    }


def test_growing_mismatch_tightens_to_one_and_calm_steps_relax_it(caplog):
    control = StalenessControl(StalenessControlConfig(tighten_above=0.01, relax_below=0.002), 3)
    with caplog.at_level(logging.INFO):
        moves = replay(control, DRIFTING)
    # step 3 (0.02) and 4 (0.03) tighten 3 -> 2 -> 1; step 5 (0.012) cannot go below 1;
    # steps 6 and 7 are calm: relaxed to 2 after the second
    assert moves == [(3, 0), (3, 0), (2, -1), (1, -1), (1, 0), (1, 0), (2, 1)]
    logged = [r.getMessage() for r in caplog.records if "control:" in r.getMessage()]
    assert logged == [
        "relax-launch: control: max_staleness tightened to 2 after step 3 (mismatch_kl 0.02; "
        "algorithm.control.staleness)",
        "relax-launch: control: max_staleness tightened to 1 after step 4 (mismatch_kl 0.03; "
        "algorithm.control.staleness)",
        "relax-launch: control: max_staleness relaxed to 2 after step 7 (mismatch_kl 0.0008; "
        "algorithm.control.staleness)",
    ]


def test_on_policy_steps_never_tighten_and_relaxing_stops_at_max_staleness():
    control = StalenessControl(StalenessControlConfig(tighten_above=0.001, patience=1), 2)
    # on-policy steps (staleness 0) with a large KL are the mismatch guard's, not the control's
    assert replay(control, [(0, 0.5), (0, 0.5)]) == [(2, 0), (2, 0)]
    control.bound = 1
    assert replay(control, [(1, 0.0001), (1, 0.0001)]) == [(2, 1), (2, 0)]


def test_control_is_refused_without_the_fully_asynchronous_schedule():
    with pytest.raises(
        ValueError, match="algorithm.control.staleness acts only with algorithm.max_staleness"
    ):
        AlgorithmConfig(control={"staleness": {}})
    control = AlgorithmConfig(max_staleness=2, control={"staleness": {"patience": 3}}).control
    assert control.staleness.patience == 3


def test_a_resumed_run_continues_with_the_bound_its_steps_left(caplog):
    config = StalenessControlConfig(tighten_above=0.01, relax_below=0.002)
    live = StalenessControl(config, 3)
    replay(live, DRIFTING[:6])  # tightened to 1, then one calm step (0.001)
    resumed = StalenessControl(config, 3)
    rows = [{"step": i + 1, "staleness": s, "mismatch_kl": k} for i, (s, k) in enumerate(DRIFTING)]
    with caplog.at_level(logging.INFO):
        resumed.resume(rows[:6])
    assert not [r for r in caplog.records if "control:" in r.getMessage()]  # quietly
    assert (resumed.bound, resumed.calm) == (live.bound, live.calm) == (1, 1)
    # the next calm step relaxes it, as it would have without the restart
    assert resumed.after_step(rows[6])["control/max_staleness"] == 2
