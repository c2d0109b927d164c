"""The shared spare pool's policy: which role's engines the pool's ranks run, as a pure function
of observations and time (no clock, network or file), so ``bench/pool_sim.py`` runs it unchanged.

In an RL step the load moves between roles: the rollout engines generate, then the teacher scores
and the judge grades, then the trainer trains. A spare rank reserved for one role idles while the
step waits on another; a pool rank can serve whichever role the step waits on, if moving it pays
for its start. Every ``decide`` sees each role's demand and returns the moves, each with its
reasons:

- a teacher or judge (load role) engine helps the burst under way: with ``R`` requests left,
  ``n`` engines of ``mu`` requests/s each (the requests answered over the seconds the role was
  saturated, readings with none answered included), and ``k`` more after a start of ``s``
  seconds, the burst ends ``R/(n mu) - (s + (R - n mu s)/((n+k) mu))`` seconds sooner. It asks
  for no more engines than ``ceil(R / target_queue_per_engine)``: below that the engines are not
  saturated and more do not shorten the burst.
- a rollout engine is routed only after the next weight sync, so it helps the next rollout
  phase, not this one: the engine-seconds ``W`` of the last phase's body (while more requests
  were left than engines; its tail, the last requests, more engines do not shorten) end
  ``W/n - W/(n+k)`` sooner.

A move is made when its gain is at least ``min_gain_s``. Ranks come from the free pool, else
from a role that holds pool engines and has been idle for ``hold_s`` (the hysteresis: a role
between two bursts keeps its engines), when what the donor loses is ``min_gain_s`` below what
the recipient gains. A rollout donor loses nothing when its engines can start again before its
next phase (the gap between its phases, measured); a load donor loses nothing (its next burst
asks again, and pays that start then). A donor takes pool ranks again no sooner than one start
of its engine after it gave them (a move back pays that start: the readings calling for it must
span as long, so one reading that jumps moves nothing back); a give counts once the scaler
accepted it (``accepted``): one refused freed nothing and holds the donor back from nothing.
One operation per role at a time, as ``EngineScaler``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ROLLOUT = "rollout"


@dataclass(frozen=True)
class PoolPolicyConfig:
    """The policy's knobs (``cluster.spare_autoscale`` in a job)."""

    target_queue_per_engine: float = 4.0  # requests one engine takes before another helps
    min_gain_s: float = 5.0  # seconds a move must save, after its start cost
    hold_s: float = 5.0  # a role idle this long may give its pool engines to another
    rate_smoothing: float = 0.5  # weight of the newest throughput reading


@dataclass(frozen=True)
class RoleView:
    """One role, as the policy sees it at one reading."""

    role: str
    width: int  # ranks per engine
    engines: int  # counted towards a target: planned + pool engines held (serving or starting)
    serving: int  # routed now
    held: int  # pool engines the role holds
    most: int  # max_engines: the cap on the role's engines
    outstanding: float  # requests queued and running at its engines (or in flight, if more)
    answered: float  # requests answered so far (its throughput is read from this)
    start_s: float  # one engine's start until it serves: load (+ the first weight sync)
    busy: bool = False  # an operation of the role is in flight
    phase: bool = False  # rollout: a rollout phase runs


@dataclass(frozen=True)
class PoolView:
    """Every elastic role and the pool's free ranks at time ``now`` (monotonic seconds)."""

    now: float
    free_ranks: int
    roles: tuple[RoleView, ...]
    waiting_on: str | None = None  # the role the RL step waits on (None: training, unknown)

    def role(self, name: str) -> RoleView:
        return next(r for r in self.roles if r.role == name)


@dataclass(frozen=True)
class Move:
    """Scale ``role`` (``scale_out`` | ``scale_in``) to ``target`` engines, and why."""

    role: str
    direction: str
    target: int
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoleEstimate:
    """What the policy learnt of a role from the readings so far."""

    rate: float | None = None  # requests/s per engine while saturated
    last: tuple[float, float] | None = None  # (time, answered) of the previous reading
    # (time, answered) the rate counts from: the saturated stretch's last answer, so readings
    # with nothing answered (a judge answering a batch at once) count as time, not as nothing
    window: tuple[float, float, int] | None = None  # (since, answered, serving) saturated
    idle_since: float | None = None  # nothing outstanding (and no phase) since
    phase_started: float | None = None
    body_s: float = 0.0  # seconds of the phase under way with more requests left than engines
    in_body: bool = False  # at the previous reading
    phase_engine_s: float | None = None  # the last rollout phase's engines x body seconds
    phase_ended: float | None = None
    gap_s: float | None = None  # seconds from a rollout phase's end to the next one's start
    gave_at: float | None = None  # when it last gave pool ranks to another role


class PoolPolicy:
    """See the module docstring. ``decide`` once per reading; it keeps only estimates."""

    def __init__(self, config: PoolPolicyConfig) -> None:
        self.config = config
        self.estimates: dict[str, RoleEstimate] = {}
        # the role a donor's ranks were freed for: it takes them first, so a role with a larger
        # gain (the donor itself) does not take them straight back
        self.promised: str | None = None

    def decide(self, view: PoolView) -> list[Move]:
        """The moves for this reading (none, a scale-out, or a donor's scale-in first)."""
        for role in view.roles:
            self._learn(role, view.now)
        gains = {
            r.role: self._gain(r, view)
            for r in view.roles
            if not r.busy and r.engines < r.most and (r.outstanding > 0 or r.role == ROLLOUT)
        }
        ranked = sorted(
            (
                g
                for g in gains.values()
                if g is not None
                and g[1] >= self.config.min_gain_s
                and self._settled(g[0], view.now)
            ),
            key=lambda g: (g[0].role == self.promised, g[1], view.waiting_on == g[0].role),
            reverse=True,
        )
        if self.promised not in {g[0].role for g in ranked}:
            self.promised = None  # the role the ranks were freed for no longer gains from them
        for role, gain, add, why in ranked:
            if view.free_ranks >= role.width:
                self.promised = None
                add = min(add, view.free_ranks // role.width)
                return [self._out(role, add, gain, why, view)]
            donor = self._donor(view, role, gain, add)
            if donor is not None:
                self.promised = role.role
                return [donor]
        return []

    def accepted(self, move: Move, now: float) -> None:
        """The scaler took ``move`` (one ``decide`` returned) at ``now``: a scale-in is a give
        from then on (``_settled``), a scale-out ends the role's last one. Told by the shell
        (``PoolAutoscaler``, the simulator), as a refused move must not count."""
        est = self.estimates.setdefault(move.role, RoleEstimate())
        est.gave_at = now if move.direction == "scale_in" else None

    def _settled(self, role: RoleView, now: float) -> bool:
        """Whether ``role`` may take pool ranks: one that gave ranks away takes ranks again no
        sooner than one start of its engine (``start_s``, as measured) after the give. A move
        back pays that start: the readings that call for it must span at least as long as it
        costs (rent or buy: at most twice the best move in hindsight), so a reading that jumps
        once (a judge's answers coming in groups, breaking the promise of the freed ranks)
        moves nothing back."""
        gave_at = self.estimates[role.role].gave_at
        return gave_at is None or now - gave_at >= role.start_s

    # ---- what the readings teach ---------------------------------------------------------

    def _learn(self, role: RoleView, now: float) -> None:
        est = self.estimates.setdefault(role.role, RoleEstimate())
        saturated = role.serving > 0 and role.outstanding >= role.serving
        window = est.window if saturated else None
        if window is not None and (role.answered < window[1] or role.serving != window[2]):
            window = None  # an engine came or went: its answers or its share would skew the rate
        if window is not None and now > window[0] and role.answered > window[1]:
            rate = (role.answered - window[1]) / (now - window[0]) / role.serving
            w = self.config.rate_smoothing
            est.rate = rate if est.rate is None else w * rate + (1 - w) * est.rate
        if window is None or role.answered > window[1]:  # else: the window spans the reading
            est.window = (now, role.answered, role.serving) if saturated else None
        if role.phase and est.in_body and est.last is not None:
            est.body_s += now - est.last[0]  # not its tail (a request or less an engine left)
        est.in_body = role.phase and role.outstanding > role.serving
        est.last = (now, role.answered)
        idle = role.outstanding <= 0 and not role.phase
        est.idle_since = (now if est.idle_since is None else est.idle_since) if idle else None
        if role.phase and est.phase_started is None:
            if est.phase_ended is not None:
                est.gap_s = now - est.phase_ended
            est.phase_started, est.body_s = now, 0.0
        elif not role.phase and est.phase_started is not None:
            est.phase_engine_s = role.serving * est.body_s
            est.phase_started, est.phase_ended = None, now

    # ---- what a move gains and costs -----------------------------------------------------

    def _gain(self, role: RoleView, view: PoolView) -> tuple[RoleView, float, int, str] | None:
        """(role, seconds saved, engines to add, why) of the best scale-out of ``role``."""
        room = role.most - role.engines
        pool_engines = (view.free_ranks + self._releasable(view, role)) // role.width
        most_add = min(room, pool_engines)
        if most_add <= 0:
            return None
        est = self.estimates[role.role]
        if role.role == ROLLOUT:
            if est.phase_engine_s is None:
                return None
            work, n = est.phase_engine_s, max(role.engines, 1)
            gain = work / n - work / (n + most_add)
            why = (
                f"the last rollout phase's body took {work:.1f} engine-seconds: {most_add} more "
                f"engines (routed from the next weight sync) save {gain:.1f} s a phase"
            )
            return role, gain, most_add, why
        if est.rate is None or role.outstanding <= 0:
            return None
        wanted = math.ceil(role.outstanding / self.config.target_queue_per_engine)
        add = min(most_add, wanted - role.engines)
        if add <= 0:
            return None
        gain = burst_gain(role.outstanding, role.engines, add, est.rate, role.start_s)
        why = (
            f"{role.outstanding:g} requests left at {est.rate:.2f} requests/s per engine on "
            f"{role.engines}: {add} more after a {role.start_s:g} s start end the burst "
            f"{gain:.1f} s sooner"
        )
        return role, gain, add, why

    def _releasable(self, view: PoolView, taker: RoleView) -> int:
        """Ranks that idle donors could give ``taker``."""
        return sum(
            r.held * r.width
            for r in view.roles
            if r.role != taker.role and not r.busy and self._idle_for(r, view.now)
        )

    def _idle_for(self, role: RoleView, now: float) -> bool:
        since = self.estimates[role.role].idle_since
        return since is not None and now - since >= self.config.hold_s

    def _donor(self, view: PoolView, taker: RoleView, gain: float, add: int) -> Move | None:
        """A scale-in of the idle role that loses least by giving ``taker`` the pool ranks of
        ``add`` engines (what the free ranks lack)."""
        need = add * taker.width - view.free_ranks
        best: tuple[float, Move] | None = None
        for role in view.roles:
            if role.role == taker.role or role.busy or not role.held:
                continue
            if not self._idle_for(role, view.now):
                continue
            give = min(role.held, math.ceil(need / role.width))
            loss = self._loss(role, give, view.now, taker)
            if gain - loss < self.config.min_gain_s:
                continue
            why = (
                f"idle for {view.now - (self.estimates[role.role].idle_since or view.now):.1f} s;"
                f" {taker.role} gains {gain:.1f} s from its ranks, {role.role} loses {loss:.1f} s"
            )
            move = Move(role.role, "scale_in", role.engines - give, why, {"for": taker.role})
            if best is None or loss < best[0]:
                best = (loss, move)
        return best[1] if best else None

    def _loss(self, donor: RoleView, give: int, now: float, taker: RoleView) -> float:
        """Seconds the donor's next work takes longer for giving ``give`` engines away."""
        est = self.estimates[donor.role]
        if donor.role != ROLLOUT or est.phase_engine_s is None:
            return 0.0
        if est.gap_s is not None and est.phase_ended is not None:
            left = est.gap_s - (now - est.phase_ended)
            taker_rate = self.estimates[taker.role].rate or 0.0
            burst = taker.outstanding / max(taker_rate * (taker.engines + give), 1e-9)
            if left >= taker.start_s + burst + donor.start_s:
                return 0.0  # back in time for the next phase
        n = max(donor.engines, 1)
        return est.phase_engine_s / max(n - give, 1) - est.phase_engine_s / n

    def _out(self, role: RoleView, add: int, gain: float, why: str, view: PoolView) -> Move:
        evidence = {
            "free_ranks": view.free_ranks,
            "gain_s": round(gain, 3),
            "waiting_on": view.waiting_on,
            "rate": self.estimates[role.role].rate,
        }
        return Move(role.role, "scale_out", role.engines + add, why, evidence)


def burst_gain(requests: float, engines: int, add: int, rate: float, start_s: float) -> float:
    """Seconds by which ``add`` engines, serving after ``start_s``, end a burst of ``requests``
    at ``rate`` requests/s per engine on ``engines`` sooner (0 if it ends before they serve)."""
    n = max(engines, 1)
    alone = requests / (n * rate)
    left = requests - n * rate * start_s
    if left <= 0:
        return 0.0
    return max(alone - (start_s + left / ((n + add) * rate)), 0.0)
