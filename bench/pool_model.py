"""The cluster model ``bench/pool_sim.py`` runs: a synchronous RL step on N GPUs, advanced in
ticks of ``DT`` seconds, whose inference roles' engines start, serve and stop as a scaler told
by the real autoscaler code (``runtime/pool_policy.py``; ``runtime/autoscale_policy.py`` for
per-role spares) asks.

A step: the rollout phase (the rollout engines generate every sample), then the teacher's
scoring and the judge's grading side by side, then the trainer's step and the weight sync.

A role's work in a phase is ``requests`` of ``length`` tokens each. An engine with ``b``
requests in flight makes ``peak x b / (b + half)`` tokens/s (decode is memory-bound: a few
requests use little of it), ``b`` at most ``slots``, the requests spread over the serving
engines. Once fewer requests than engines are left, the phase ends after its ``tail_s`` (its
longest request decoding alone), which more engines cannot shorten.

Engines: a judge or teacher engine serves ``start_s`` after its scale-out; a rollout engine
then waits for the next weight sync (it serves from the next rollout phase). A scale-in stops
an engine at once; what it was generating is generated again elsewhere (fluid: no work lost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DT = 0.5  # seconds a tick
INTERVAL_S = 2.0  # how often the autoscalers read the load

ROLES = ("rollout", "teacher", "genrm")


@dataclass(frozen=True)
class Work:
    """One role's work in one phase of a step."""

    requests: float
    length: float  # tokens a request
    peak: float  # an engine's tokens/s with every slot busy (saturated)
    half: float  # in-flight requests at which an engine makes half its peak
    slots: int  # requests an engine runs at once
    tail_s: float  # the phase's last request alone, after the others are done

    def rate(self, requests: float, engines: int) -> float:
        """Tokens/s of ``engines`` sharing ``requests``."""
        if engines <= 0 or requests <= 0:
            return 0.0
        b = min(self.slots, requests / engines)
        return engines * self.peak * b / (b + self.half)


@dataclass
class RoleState:
    """A role in the simulation: its engines and the phase's work left."""

    name: str
    width: int  # GPUs an engine
    start_s: float
    planned: int
    serving: int = 0
    starting: list[float] = field(default_factory=list)  # when each starting engine is up
    waiting_sync: int = 0  # rollout engines up, waiting for the next weight sync
    held: int = 0  # pool (or spare) engines held, serving or starting
    work: Work | None = None
    left: float = 0.0  # requests not yet generated
    tail_left: float = 0.0
    answered: float = 0.0
    busy_until: float | None = None  # an operation in flight until then (None: none)
    last_ended: float | None = None

    @property
    def engines(self) -> int:
        return self.serving + len(self.starting) + self.waiting_sync

    @property
    def outstanding(self) -> float:
        if self.work is None:
            return 0.0
        if self.left > 0:
            return self.left
        return min(self.work.requests, float(self.serving)) if self.tail_left > 0 else 0.0

    @property
    def done(self) -> bool:
        return self.work is None or (self.left <= 0 and self.tail_left <= 0)

    def begin(self, work: Work | None) -> None:
        self.work = work
        self.left = work.requests if work else 0.0
        self.tail_left = work.tail_s if work else 0.0

    def advance(self, now: float) -> None:
        """One tick of the work under way, and the engines that came up."""
        for ready in [t for t in self.starting if t <= now]:
            self.starting.remove(ready)
            if self.name == "rollout":
                self.waiting_sync += 1
            else:
                self.serving += 1
        if self.name != "rollout" and not self.starting and self.busy_until is not None:
            self.busy_until, self.last_ended = None, now
        work = self.work
        if work is None:
            return
        if self.left > 0 and self.left >= self.serving:
            made = work.rate(self.left, self.serving) * DT / work.length
            self.answered += min(made, self.left)
            self.left -= made
        elif self.serving:
            self.answered += max(self.left, 0.0)
            self.left = 0.0
            self.tail_left -= DT


class Scaler:
    """What ``EngineScaler`` does, in simulated time: one operation per role, engines taken
    from the role's own spare ranks (per-role spares) or from the shared pool's."""

    def __init__(self, roles: dict[str, RoleState], pool: dict[str, int] | int) -> None:
        self.roles, self.pool = roles, pool  # int: shared ranks; dict: each role's own
        self.now = 0.0
        self.log: list[dict] = []

    def free(self, role: str) -> int:
        if isinstance(self.pool, int):
            used = sum(r.held * r.width for r in self.roles.values())
            return self.pool - used
        return self.pool.get(role, 0) - self.roles[role].held * self.roles[role].width

    def request(
        self, role: str, direction: str, target: int, reason: str = "", evidence: dict | None = None
    ) -> bool:
        state = self.roles[role]
        if state.busy_until is not None:
            return False
        if direction == "scale_out":
            add = min(target - state.engines, self.free(role) // state.width)
            if add <= 0:
                return False
            state.starting += [self.now + state.start_s] * add
            state.held += add
            state.busy_until = self.now + state.start_s
        else:
            drop = min(state.engines - target, state.held)
            if drop <= 0:
                return False
            self._stop(state, drop)
            state.last_ended = self.now
        self.log.append(
            {
                "time": self.now,
                "role": role,
                "decision": direction,
                "to": target,
                "reason": reason,
                **(evidence or {}),
            }
        )
        return True

    @staticmethod
    def _stop(state: RoleState, count: int) -> None:
        """Stop ``count`` engines, those not serving yet first."""
        for _ in range(count):
            if state.starting:
                state.starting.pop()
            elif state.waiting_sync:
                state.waiting_sync -= 1
            else:
                state.serving -= 1
            state.held -= 1
        if not state.starting and state.busy_until is not None:
            state.busy_until = None

    def sync(self) -> None:
        """The weight sync: rollout engines up join it and serve from now."""
        rollout = self.roles.get("rollout")
        if rollout is not None and rollout.waiting_sync:
            rollout.serving += rollout.waiting_sync
            rollout.waiting_sync = 0
            if not rollout.starting:
                rollout.busy_until, rollout.last_ended = None, self.now


Observer = Callable[[Scaler, str | None], None]  # a tick's autoscaler: (scaler, waiting on)


@dataclass(frozen=True)
class StepWork:
    """One step: the phases' work per role (None: the role has none this step)."""

    rollout: Work
    teacher: Work | None
    genrm: Work | None
    train_s: float
    sync_s: float


class Cluster:
    """The step loop: phases run until done, the autoscaler consulted every interval."""

    def __init__(self, scaler: Scaler, observe: Observer | None, on_phase=None) -> None:
        self.scaler, self.observe, self.on_phase = scaler, observe, on_phase
        self.next_look = 0.0

    def run(self, steps: list[StepWork]) -> list[float]:
        """Each step's seconds."""
        times = []
        for step in steps:
            began = self.scaler.now
            self._phase({"rollout": step.rollout}, "rollout")
            self._phase({"teacher": step.teacher, "genrm": step.genrm}, None)
            self._idle(step.train_s)
            self.scaler.sync()
            self._idle(step.sync_s)
            times.append(self.scaler.now - began)
        return times

    def _phase(self, works: dict[str, Work | None], waiting: str | None) -> None:
        roles = self.scaler.roles
        active = [roles[n] for n, w in works.items() if w is not None and n in roles]
        for state in active:
            state.begin(works[state.name])
        started = self.scaler.now
        engines = roles["rollout"].serving
        while not all(s.done for s in active):
            on = waiting or max(active, key=lambda s: s.outstanding).name
            self._tick(on)
        if waiting == "rollout" and self.on_phase is not None:
            self.on_phase(started, self.scaler.now, engines, works["rollout"].requests)
        for state in active:
            state.begin(None)

    def _idle(self, seconds: float) -> None:
        end = self.scaler.now + seconds
        while self.scaler.now < end - 1e-9:
            self._tick(None)

    def _tick(self, waiting: str | None) -> None:
        scaler = self.scaler
        scaler.now += DT
        for state in scaler.roles.values():
            state.advance(scaler.now)
        if self.observe is not None and scaler.now >= self.next_look:
            self.next_look = scaler.now + INTERVAL_S
            self.observe(scaler, waiting)
