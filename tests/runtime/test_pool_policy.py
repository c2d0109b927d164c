"""The shared spare pool's policy (``runtime/pool_policy.py``): readings in, moves out. The
cluster-scale model driving it is ``bench/pool_sim.py``; the last test runs that model for a
few steps."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from relax_launch.runtime.pool_policy import (
    PoolPolicy,
    PoolPolicyConfig,
    PoolView,
    RoleView,
    burst_gain,
)

CONFIG = PoolPolicyConfig(target_queue_per_engine=4, min_gain_s=5, hold_s=5)


def role(name: str, **kw) -> RoleView:
    base = dict(
        role=name,
        width=1,
        engines=1,
        serving=1,
        held=0,
        most=4,
        outstanding=0.0,
        answered=0.0,
        start_s=10.0,
    )
    return RoleView(**{**base, **kw})


def test_a_burst_gains_what_the_engines_after_their_start_take_off_it() -> None:
    # 100 requests at 1/s on 1 engine: 100 s; 1 more after 10 s: 10 + 90/2 = 55 s, 45 s sooner
    assert burst_gain(100, 1, 1, 1.0, 10.0) == pytest.approx(45.0)
    assert burst_gain(5, 1, 3, 1.0, 10.0) == 0.0  # over before the new engines serve


def test_a_judge_burst_takes_free_ranks_once_its_throughput_is_read() -> None:
    policy = PoolPolicy(CONFIG)
    judge = role("genrm", outstanding=40.0)
    assert policy.decide(PoolView(0.0, 2, (judge,))) == []  # no throughput known yet
    judge = replace(judge, outstanding=30.0, answered=10.0)
    (move,) = policy.decide(PoolView(10.0, 2, (judge,), waiting_on="genrm"))
    # 30 requests at 1/s: wants ceil(30 / 4) = 8 engines, the pool has 2 ranks, max_engines 4
    assert (move.role, move.direction, move.target) == ("genrm", "scale_out", 3)
    assert "1.00 requests/s" in move.reason and move.evidence["waiting_on"] == "genrm"


def test_a_judge_answering_in_batches_is_read_at_its_rate_not_its_batches() -> None:
    """A CPU judge answers its requests a few at a time (one prefill for several): 4 answers
    every 4 s is 1 request/s, not 4 answers in the last half-second's reading (8/s), which
    made a long judge burst look too short to pay a start."""
    policy = PoolPolicy(CONFIG)
    for tick in range(17):  # a reading every 0.5 s, 4 answered at each 4 s
        judge = role("genrm", outstanding=60.0 - tick // 8 * 4, answered=tick // 8 * 4.0)
        policy.decide(PoolView(tick * 0.5, 0, (judge,), waiting_on="genrm"))
    assert policy.estimates["genrm"].rate == pytest.approx(1.0)


def test_an_engine_joining_or_leaving_restarts_the_rate_window() -> None:
    """Answers counted over engines that came or went would skew the rate: an engine removed
    lowers the role's answered total (the window stretched on, the rate came out low), one
    added would have its answers divided among engines that were not all serving."""
    policy = PoolPolicy(CONFIG)
    policy.decide(PoolView(0.0, 0, (role("genrm", outstanding=40.0, serving=2, engines=2),)))
    gone = role("genrm", outstanding=40.0, answered=0.0)  # one of the two engines left
    policy.decide(PoolView(5.0, 0, (gone,)))
    policy.decide(PoolView(10.0, 0, (replace(gone, outstanding=35.0, answered=5.0),)))
    # 5 answers over the 5 s since the engine left: 1/s (the stretched window gave 0.5/s)
    assert policy.estimates["genrm"].rate == pytest.approx(1.0)


def test_no_move_for_a_busy_role_a_role_at_its_cap_or_a_gain_below_the_minimum() -> None:
    for changed in ({"busy": True}, {"most": 1}, {"start_s": 1000.0}):
        policy = PoolPolicy(CONFIG)
        judge = role("genrm", outstanding=40.0, **changed)
        policy.decide(PoolView(0.0, 2, (judge,)))
        judge = replace(judge, outstanding=30.0, answered=10.0)
        assert policy.decide(PoolView(10.0, 2, (judge,))) == [], changed


def phases(policy: PoolPolicy, rollout: RoleView, others: tuple[RoleView, ...], t: float) -> float:
    """A rollout phase of 100 s (60 s with more requests left than engines), then idle."""
    readings = ((t, 50.0, True), (t + 60, 0.5, True), (t + 80, 0.5, True), (t + 100, 0.0, False))
    for now, left, phase in readings:
        r = replace(rollout, outstanding=left, phase=phase)
        policy.decide(PoolView(now, 0, (r, *others)))
    return t + 100


def test_rollout_gains_from_its_last_phase_body_and_an_idle_donor_gives_it_ranks() -> None:
    policy = PoolPolicy(CONFIG)
    rollout = role("rollout", engines=2, serving=2)
    judge = role("genrm", engines=3, serving=3, held=2)  # holds the pool's 2 ranks, idle
    end = phases(policy, rollout, (judge,), 0.0)
    assert policy.estimates["rollout"].phase_engine_s == pytest.approx(120.0)
    # judge idle since t=0 (more than hold_s): it gives its 2 pool engines back
    (move,) = policy.decide(PoolView(end + 1, 0, (rollout, judge)))
    assert (move.role, move.direction, move.target) == ("genrm", "scale_in", 1)
    assert move.evidence == {"for": "rollout"}
    (move,) = policy.decide(PoolView(end + 3, 2, (rollout, replace(judge, engines=1, held=0))))
    # 120 engine-seconds on 2 engines: 60 s; on 4: 30 s
    assert (move.role, move.direction, move.target) == ("rollout", "scale_out", 4)
    assert move.evidence["gain_s"] == pytest.approx(30.0)


def test_a_role_idle_for_less_than_hold_s_keeps_its_pool_engines() -> None:
    policy = PoolPolicy(CONFIG)
    rollout = role("rollout", engines=2, serving=2)
    judge = role("genrm", engines=3, serving=3, held=2, outstanding=3.0)
    end = phases(policy, rollout, (judge,), 0.0)
    judge = replace(judge, outstanding=0.0)
    assert policy.decide(PoolView(end + 1, 0, (rollout, judge))) == []  # idle since end + 1
    (move,) = policy.decide(PoolView(end + 7, 0, (rollout, judge)))
    assert move.direction == "scale_in" and move.role == "genrm"


def test_ranks_freed_for_a_role_go_to_it_not_back_to_the_donor() -> None:
    """The rollout role (larger gain) gives its idle pool engines to the judge's burst; the
    freed ranks then go to the judge, not straight back to the rollout role."""
    policy = PoolPolicy(replace(CONFIG, target_queue_per_engine=1))
    rollout = role("rollout", engines=4, serving=4, held=2, start_s=1.0, most=6)
    judge = role("genrm", outstanding=0.0, start_s=1.0)
    t = phases(policy, rollout, (judge,), 0.0)  # learns 240 engine-seconds a phase
    t = phases(policy, rollout, (judge,), t + 200)  # and 200 s between phases: time to restart
    policy.decide(PoolView(t, 0, (rollout, replace(judge, outstanding=200.0))))
    judge = replace(judge, outstanding=180.0, answered=20.0)
    (give,) = policy.decide(PoolView(t + 10, 0, (rollout, judge)))
    assert (give.role, give.direction, give.target) == ("rollout", "scale_in", 2)
    rollout = replace(rollout, engines=2, serving=2, held=0)
    judge = replace(judge, outstanding=170.0, answered=30.0)
    (take,) = policy.decide(PoolView(t + 11, 2, (rollout, judge)))
    assert (take.role, take.direction, take.target) == ("genrm", "scale_out", 3)


def a_rollout_give_then_a_judge_reading_that_jumps(accepted: bool) -> tuple:
    """Rollout gives its pool rank for a judge burst (the scaler taking the give or not), and
    half a second later one reading catches two groups of the judge's answers (they come four
    at a time): its rate jumps and its gain falls under min_gain_s. (policy, rollout, judge,
    the give's time, the moves of that reading.)"""
    policy = PoolPolicy(replace(CONFIG, hold_s=1.0))
    rollout = role("rollout", engines=2, serving=2, held=1, most=2, start_s=81.0)
    judge = role("genrm", most=2, start_s=35.0)
    t = phases(policy, rollout, (judge,), 0.0)
    t = phases(policy, rollout, (judge,), t + 300)  # 300 s between phases: time to restart
    policy.decide(PoolView(t, 0, (rollout, replace(judge, outstanding=200.0)), "genrm"))
    judge = replace(judge, outstanding=196.0, answered=4.0)  # four answers in 2.5 s
    (give,) = policy.decide(PoolView(t + 2.5, 0, (rollout, judge), "genrm"))
    assert (give.role, give.direction, give.evidence) == ("rollout", "scale_in", {"for": "genrm"})
    if accepted:
        policy.accepted(give, t + 2.5)
        rollout = replace(rollout, engines=1, serving=1, held=0)
    judge = replace(judge, outstanding=188.0, answered=12.0)  # two groups in the next 0.5 s
    free = 1 if accepted else 0
    return policy, rollout, judge, t + 2.5, policy.decide(PoolView(t + 3.0, free, (rollout, judge)))


def test_a_donor_does_not_take_its_ranks_back_on_one_reading_that_jumps() -> None:
    """The real pool job's wasted move: after that reading rollout took the rank straight
    back, a 76 s start for nothing. A role that gave ranks takes ranks again no sooner than one
    start of its engine after the give."""
    policy, rollout, judge, gave, moves = a_rollout_give_then_a_judge_reading_that_jumps(True)
    assert moves == []
    # one start after the give, the rollout role's gain (a phase 60 s shorter) takes it back
    (take,) = policy.decide(PoolView(gave + 81.0, 1, (rollout, replace(judge, outstanding=0))))
    assert (take.role, take.direction, take.target) == ("rollout", "scale_out", 2)


def test_a_give_the_scaler_refused_holds_the_donor_back_from_nothing() -> None:
    """A give refused (an operator's scale-in of rollout was under way: 409) freed nothing for
    the judge: once that scale-in freed the rank, rollout may take it again at once, not only
    one start after a give that never was."""
    policy, rollout, judge, gave, moves = a_rollout_give_then_a_judge_reading_that_jumps(False)
    assert moves == []  # no free rank yet, and the judge's gain is gone
    rollout = replace(rollout, held=0, engines=1, serving=1)  # the operator's scale-in ended
    (take,) = policy.decide(PoolView(gave + 1.0, 1, (rollout, replace(judge, outstanding=0))))
    assert (take.role, take.direction, take.target) == ("rollout", "scale_out", 2)


def test_a_rollout_donor_that_could_not_restart_before_its_next_phase_counts_the_loss() -> None:
    policy = PoolPolicy(CONFIG)
    rollout = role("rollout", engines=4, serving=4, held=2, start_s=500.0)
    judge = role("genrm", start_s=1.0)
    t = phases(policy, rollout, (judge,), 0.0)
    t = phases(policy, rollout, (judge,), t + 20)  # phases 20 s apart: no time to restart
    policy.decide(PoolView(t, 0, (rollout, replace(judge, outstanding=12.0))))
    judge = replace(judge, outstanding=6.0, answered=6.0)
    # the judge gains about 2 s; the rollout role would lose 240/2 - 240/4 = 60 s: no move
    assert policy.decide(PoolView(t + 6, 0, (rollout, judge))) == []


def test_the_simulator_moves_pool_engines_between_roles_within_a_run() -> None:
    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        sim = importlib.import_module("pool_sim")
    finally:
        sys.path.remove(str(bench))
    load = sim.WORKLOADS["alternating"][1]
    steps = [sim.step_work(load(s, 12, 1536), 8, 0.1) for s in range(12)]
    seconds, moves, log = sim.run("pool", steps, 24, 0.1)
    static, _, _ = sim.run("static", steps, 24, 0.1)
    assert {entry["role"] for entry in log} >= {"rollout", "teacher", "genrm"}
    assert moves == len(log) > 3 and seconds < static
