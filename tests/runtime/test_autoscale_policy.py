"""The rollout autoscaler over simulated RL steps (``runtime/autoscale_policy.py``,
``runtime/autoscaler.py``): rollout phases with load, long train phases with none, and a
scale-out routed only at the weight sync after its engine started, as ``EngineScaler`` does.
The real job is in ``tests/rl/test_elastic_job.py`` (slow)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from relax_launch.inference.config import AutoscaleConfig, RolloutAutoscaleConfig, RolloutConfig
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.rl import async_rollout
from relax_launch.runtime.autoscale_policy import Load, PhasePolicy, RolloutPhase, Scaling
from relax_launch.runtime.autoscaler import (
    Autoscaler,
    LoadAutoscaler,
    PhaseAutoscaler,
    autoscaler_for,
)


class SimulatedRollout:
    """A rollout role and its scaler in simulated seconds. A step is a rollout phase of
    ``requests`` taking ``work_s / engines`` seconds, a train phase of ``train_s`` with no load,
    then the weight sync: a scale-out's engines start for ``start_s`` and are routed at the
    first sync after that (its operation runs until then, its count is the target from the
    request on, as ``EngineScaler.count``); a scale-in drains idle engines at once."""

    def __init__(self, *, requests: int, work_s: float, train_s: float, start_s: float) -> None:
        self.requests, self.work_s, self.train_s, self.start_s = requests, work_s, train_s, start_s
        self.now, self.serving = 0.0, 1
        self.active: dict[str, object] = {}
        self.ended: dict[str, float] = {}
        self.pending: tuple[int, float] | None = None  # (target, when its engines are up)
        self.operations: list[tuple[float, str, int]] = []  # (when, kind, target)

    # ---- the scaler, as the autoscalers read and ask it ------------------------------------

    def count(self, role: str) -> int:
        return self.pending[0] if self.pending else self.serving

    def request(self, role: str, kind: str, target: int, source: str) -> object:
        if self.active:
            raise ScaleRefused(409, "an operation is in flight")
        self.operations.append((self.now, kind, target))
        op = type("Op", (), {"request_id": f"op{len(self.operations)}"})()
        if kind == "scale_out":
            self.active["rollout"], self.pending = op, (target, self.now + self.start_s)
        else:
            self.serving, self.ended["rollout"] = target, self.now
        return op

    # ---- the RL loop ---------------------------------------------------------------------

    def step(self, scale: Autoscaler) -> None:
        """One step: the autoscaler sees what the job shows it (the load every second, the
        rollout phase when it ends)."""
        started, engines = self.now, self.serving
        self._advance(scale, self.work_s / engines, self.requests)
        if hasattr(scale, "observe"):  # a phase policy
            scale.observe(RolloutPhase(started, self.now, engines, self.requests))
        self._advance(scale, self.train_s, 0)
        if self.pending and self.now >= self.pending[1]:  # the sync takes the new engines in
            self.serving, self.pending = self.pending[0], None
            self.active.clear()
            self.ended["rollout"] = self.now

    def _advance(self, scale: Autoscaler, seconds: float, load: int) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now = min(self.now + 1.0, end)
            if hasattr(scale, "tick"):  # a load policy
                scale.tick(Load(0, 0, load), self.now)

    def kinds(self) -> list[str]:
        return [kind for _, kind, _ in self.operations]


def rollout_autoscaler(tmp_path, sim: SimulatedRollout, **autoscale) -> PhaseAutoscaler:
    """The rollout role's autoscaler as the session builds it: 1 planned engine, up to 3."""
    section = RolloutConfig(ranks=1, max_engines=3, autoscale=autoscale)
    made = autoscaler_for("rollout", section, sim, None, tmp_path / "autoscaler.jsonl")
    assert isinstance(made, PhaseAutoscaler)
    return made


# 8 requests a phase (2 engines at 4 per engine), 40 engine-seconds of generation, then 90 s of
# training: longer than the 60 s scale-down window of the load policy's defaults
LONG_TRAIN = {"requests": 8, "work_s": 40.0, "train_s": 90.0, "start_s": 30.0}


def test_the_rollout_autoscaler_keeps_its_engines_across_steps_with_long_train_phases(tmp_path):
    sim = SimulatedRollout(**LONG_TRAIN)
    scale = rollout_autoscaler(tmp_path, sim)
    for _ in range(10):
        sim.step(scale)
    assert sim.operations == [(40.0, "scale_out", 2)], sim.operations  # after the first phase
    assert sim.serving == 2 and scale.metrics() == {
        "rollout/autoscale_decisions": 1.0,
        "rollout/autoscale_wanted": 2.0,
    }
    [logged] = [json.loads(line) for line in (tmp_path / "autoscaler.jsonl").open()]
    assert (logged["decision"], logged["from"], logged["to"]) == ("scale_out", 1, 2)
    assert logged["request_id"] == "op1" and logged["policy"] == "rollout_phase"
    [phase] = logged["phases"]
    assert (phase["seconds"], phase["requests"], phase["engines"], phase["need"]) == (40, 8, 1, 2)
    assert "8 requests" not in logged["reason"] and "4 per engine" in logged["reason"]


def test_the_load_policy_on_the_same_rollout_starts_and_stops_an_engine_every_step(tmp_path):
    """What the rollout role ran before (and genrm/teacher still run): the simulation above
    flaps under it, so it tells a flapping policy from one that holds."""
    sim = SimulatedRollout(**LONG_TRAIN)
    section = AutoscaleConfig()  # the defaults: 10 s up, 60 s down, 30 s cooldown
    scale = LoadAutoscaler("rollout", section, (1, 3), sim, None, tmp_path / "autoscaler.jsonl")
    for _ in range(10):
        sim.step(scale)
    assert sim.kinds().count("scale_out") >= 4 and sim.kinds().count("scale_in") >= 4, sim.kinds()


def test_a_scale_out_not_routed_before_the_next_phase_ends_waits_for_a_later_phase(tmp_path):
    # the new engine takes 150 s to start: it misses the next syncs, and the phases that end
    # meanwhile (one engine serving, wanting three once the batch grew) ask nothing
    sim = SimulatedRollout(requests=8, work_s=40.0, train_s=20.0, start_s=150.0)
    scale = rollout_autoscaler(tmp_path, sim)
    sim.step(scale)
    sim.requests = 12  # 3 engines at 4 per engine
    for _ in range(3):
        sim.step(scale)
    assert sim.kinds() == ["scale_out"] and sim.serving == 2, sim.operations
    sim.step(scale)  # the first phase with two engines: now the third
    assert [target for _, _, target in sim.operations] == [2, 3]
    logged = [json.loads(line) for line in (tmp_path / "autoscaler.jsonl").open()]
    assert [d["to"] for d in logged] == [2, 3] and not any("refused" in d for d in logged)
    assert logged[1]["phases"][0]["engines"] == 2


def test_it_scales_in_after_several_quiet_phases_and_not_at_a_counts_edge(tmp_path):
    sim = SimulatedRollout(requests=8, work_s=40.0, train_s=90.0, start_s=30.0)
    scale = rollout_autoscaler(tmp_path, sim, target_queue_per_engine=4)
    sim.step(scale)
    sim.step(scale)  # routed at the first sync: 2 engines now
    sim.requests = 7  # 1.75 engines: at 80% of the target one engine is not enough
    for _ in range(5):
        sim.step(scale)
    assert sim.kinds() == ["scale_out"], sim.operations
    sim.requests = 2  # 0.5 engines: one engine, after three phases in a row
    for _ in range(2):
        sim.step(scale)
    assert sim.kinds() == ["scale_out"]
    sim.step(scale)
    assert sim.kinds() == ["scale_out", "scale_in"] and sim.serving == 1
    for _ in range(5):
        sim.step(scale)
    assert sim.kinds() == ["scale_out", "scale_in"]


def test_a_target_phase_time_asks_for_the_engines_that_would_have_met_it():
    policy = PhasePolicy(RolloutAutoscaleConfig(target_phase_s=30), (1, 4))
    idle = Scaling(engines=1, busy=False, last_ended=None)
    decision = policy.decide(RolloutPhase(0.0, 75.0, 1, 8), idle)  # 75 s at 1: 2.5 engines
    assert (decision.direction, decision.target) == ("scale_out", 3)
    assert "target of 30 s" in decision.reason
    two = Scaling(engines=3, busy=False, last_ended=75.0)
    assert policy.decide(RolloutPhase(70.0, 95.0, 3, 8), two) is None  # began before it ended
    for start in (100.0, 200.0):
        assert policy.decide(RolloutPhase(start, start + 18.0, 3, 8), two) is None  # 1.8: 3 kept
    policy = PhasePolicy(RolloutAutoscaleConfig(target_phase_s=30, scale_down_phases=1), (1, 4))
    decision = policy.decide(RolloutPhase(300.0, 310.0, 3, 8), two)  # 1.0 engine: 2 at 80%
    assert (decision.direction, decision.target) == ("scale_in", 2)


def test_the_fully_asynchronous_schedule_sizes_by_keeping_the_trainer_fed():
    config = RolloutAutoscaleConfig(scale_down_phases=2)
    policy = PhasePolicy(config, (1, 4))
    at_two = Scaling(engines=2, busy=False, last_ended=None)
    # busy all 30 s of the step while the trainer waited 10: 2 x 30 / 20 = 3 engines
    starved = RolloutPhase(0.0, 30.0, 2, 8, busy_s=30.0, waited_s=10.0)
    decision = policy.decide(starved, at_two)
    assert (decision.direction, decision.target) == ("scale_out", 3)
    assert "engine-busy seconds" in decision.reason
    # busy a third of the time, the trainer never waited: 2 x 10 / 30 = 0.67, one engine
    policy = PhasePolicy(config, (1, 4))
    fed = [RolloutPhase(t, t + 30.0, 2, 8, busy_s=10.0, waited_s=0.0) for t in (0.0, 30.0)]
    assert policy.decide(fed[0], at_two) is None
    decision = policy.decide(fed[1], at_two)
    assert (decision.direction, decision.target) == ("scale_in", 1)


def test_a_phase_whose_engines_changed_or_that_failed_decides_nothing(tmp_path):
    sim = SimulatedRollout(**LONG_TRAIN)
    scale = rollout_autoscaler(tmp_path, sim)
    assert scale.observe(RolloutPhase(0.0, 40.0, None, 8)) is None  # an engine came or went
    scale.manager = type("Manager", (), {"serving": lambda self: ["rollout/0"]})()
    with pytest.raises(RuntimeError), scale.phase(8):
        raise RuntimeError("the generation failed")
    assert sim.operations == []
    with scale.phase(8) as work:
        assert work.requests == 8
    assert sim.kinds() == ["scale_out"]  # 8 requests at 4 per engine


def test_the_continuous_rollout_counts_the_seconds_its_engines_were_busy(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(async_rollout, "time", SimpleNamespace(monotonic=lambda: now[0]))
    settings = {"agent": None, "n": 2, "max_staleness": 1, "sampling": {}, "max_tokens": 8}
    rollout = async_rollout.ContinuousRollout(None, None, None, None, **settings, version=0)
    rollout._count_in_flight(+1)  # 100: busy from here
    now[0] = 103.0
    rollout._count_in_flight(+1)
    rollout._count_in_flight(-1)
    now[0] = 105.0
    rollout._count_in_flight(-1)  # 105: idle
    now[0] = 110.0
    rollout._count_in_flight(+1)  # 110: busy again, still at the read
    now[0] = 112.0
    assert rollout.busy_seconds() == 7.0  # 5 + 2
    now[0] = 113.0
    rollout._count_in_flight(-1)
    assert rollout.busy_seconds() == 1.0 and rollout.busy_seconds() == 0.0
