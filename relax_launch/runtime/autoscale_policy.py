"""The autoscaler's decisions, as pure policies: observations and times in, a decision out.
Neither reads a clock, the network or a file, so a simulator runs them unchanged; the shell
that reads the observations and asks the ``EngineScaler`` is ``runtime/autoscaler.py``.

- ``LoadPolicy`` (teacher, genrm): the engines' instantaneous load (queued and running requests,
  or the requests in flight to them), held for a window before it acts. Their load includes
  what outside clients send through the gateway, which has no phases, and a new engine of theirs
  is routed as soon as it is up, so it meets the load that asked for it.
- ``PhasePolicy`` (rollout): the rollout phase's demand across steps. A rollout role's load is
  the RL batch itself (everything at a phase's start, nothing while the trainer trains) and a
  new engine is routed only after the next weight sync, after the burst that asked for it: the
  load policy would start an engine in every rollout phase and stop it in every long train
  phase. ``PhasePolicy`` decides once per finished phase, from what that phase had to do and how
  long it took, and never from the idleness between phases.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from relax_launch.inference.config import AutoscaleConfig, RolloutAutoscaleConfig


@dataclass(frozen=True)
class Scaling:
    """What the policies know of the role's engines: the count requests target now, whether a
    scale operation runs, and when the last one ended (monotonic seconds, None: never)."""

    engines: int
    busy: bool
    last_ended: float | None


@dataclass(frozen=True)
class Decision:
    """Scale ``direction`` (``scale_out`` | ``scale_in``) to ``target`` engines, and why."""

    direction: str
    target: int
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Load:
    """One reading of a role's load."""

    queued: float  # waiting in the engines
    running: float  # being generated
    in_flight: int  # sent by the gateway and the controller, unanswered

    @property
    def requests(self) -> float:
        return max(self.queued + self.running, float(self.in_flight))


def clamp(count: int, bounds: tuple[int, int]) -> int:
    return min(max(count, bounds[0]), bounds[1])


class LoadPolicy:
    """``ceil(load / target_queue_per_engine)`` engines within the bounds, once wanted for
    ``scale_up_window_s`` (more) or ``scale_down_window_s`` (fewer); nothing while an operation
    runs nor for ``cooldown_s`` after one ended."""

    def __init__(self, config: AutoscaleConfig, bounds: tuple[int, int]) -> None:
        self.config, self.bounds = config, bounds
        self.wanted: int | None = None  # engines wanted at the last reading
        self.since: tuple[str, float] | None = None  # (direction, since when it is wanted)

    def decide(self, load: Load, scaling: Scaling, now: float) -> Decision | None:
        config, current = self.config, scaling.engines
        self.wanted = clamp(math.ceil(load.requests / config.target_queue_per_engine), self.bounds)
        ended = scaling.last_ended
        cooling = ended is not None and now - ended < config.cooldown_s
        if scaling.busy or cooling or self.wanted == current:
            self.since = None
            return None
        direction = "scale_out" if self.wanted > current else "scale_in"
        if self.since is None or self.since[0] != direction:
            self.since = (direction, now)
        up = direction == "scale_out"
        window = config.scale_up_window_s if up else config.scale_down_window_s
        if now - self.since[1] < window:
            return None
        self.since = None
        reason = (
            f"{load.requests:g} requests want {self.wanted} engines at "
            f"{config.target_queue_per_engine:g} per engine, for {window:g} s"
        )
        return Decision(direction, self.wanted, reason)


@dataclass(frozen=True)
class RolloutPhase:
    """One finished rollout phase. A separated phase (synchronous, one-step off-policy) is a
    step's generation: ``requests`` waiting at its start (prompts x samples), done between
    ``started`` and ``ended``. In the fully asynchronous schedule generation never stops, so a
    phase is the stretch of one step before its weight sync: ``busy_s`` the seconds the engines
    had requests in flight then, ``waited_s`` the seconds the trainer waited for finished groups.
    ``engines`` served throughout (None: the count changed while it ran)."""

    started: float
    ended: float
    engines: int | None
    requests: int
    busy_s: float | None = None
    waited_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class PhasePolicy:
    """Engines from the rollout phases' demand (see the module docstring):

    - a separated phase needs ``engines x seconds / target_phase_s`` engines (the count that
      would have generated it in the target time, throughput taken as proportional to the
      engines), or, without ``target_phase_s``, ``requests / target_queue_per_engine``;
    - a fully asynchronous phase needs ``engines x busy_s / (seconds - waited_s)``: the engine
      time its samples took, over the trainer's own time (so the trainer never waits).

    Only a phase that ran with the role's current engines, that started after the last scale
    operation ended and while none runs, is evidence: a scale-out still starting (or waiting for
    its weight sync) when the next phase ends asks nothing more, that phase's demand is the next
    decision's. It scales out once ``scale_up_phases`` phases in a row wanted more (to the fewest
    of them), in once ``scale_down_phases`` wanted fewer with ``scale_in_margin`` to spare (to the
    most of them)."""

    def __init__(self, config: RolloutAutoscaleConfig, bounds: tuple[int, int]) -> None:
        self.config, self.bounds = config, bounds
        self.evidence: deque[tuple[RolloutPhase, float]] = deque(
            maxlen=max(config.scale_up_phases, config.scale_down_phases)
        )  # the last phases that count, each with the engines it needed
        self.wanted: int | None = None  # engines the last phase wanted

    def need(self, phase: RolloutPhase) -> float:
        """Engines the phase needed (fractional): see the class docstring."""
        engines = phase.engines or 0
        if phase.busy_s is not None:  # fully asynchronous: keep the trainer fed
            own = max(phase.seconds - (phase.waited_s or 0.0), 1e-3)
            return engines * phase.busy_s / own
        if self.config.target_phase_s is not None:
            return engines * phase.seconds / self.config.target_phase_s
        return phase.requests / self.config.target_queue_per_engine

    def decide(self, phase: RolloutPhase, scaling: Scaling) -> Decision | None:
        ended = scaling.last_ended
        counts = (
            not scaling.busy
            and phase.engines == scaling.engines
            and (ended is None or phase.started >= ended)
        )
        if not counts:  # not run with today's engines: what it asks is the next phase's to say
            self.evidence.clear()
            return None
        need = self.need(phase)
        self.wanted = clamp(math.ceil(need - 1e-9), self.bounds)
        self.evidence.append((phase, need))
        decision = self._out(scaling.engines) or self._in(scaling.engines)
        if decision is not None:
            self.evidence.clear()  # what comes next runs with other engines
        return decision

    def _last(self, count: int) -> list[tuple[RolloutPhase, float]] | None:
        return list(self.evidence)[-count:] if len(self.evidence) >= count else None

    def _out(self, current: int) -> Decision | None:
        last = self._last(self.config.scale_up_phases)
        if last is None:
            return None
        wanted = [clamp(math.ceil(need - 1e-9), self.bounds) for _, need in last]
        target = min(wanted)
        if target <= current:
            return None
        return Decision("scale_out", target, self._why(last, target), self._evidence(last))

    def _in(self, current: int) -> Decision | None:
        last = self._last(self.config.scale_down_phases)
        if last is None:
            return None
        spare = 1.0 - self.config.scale_in_margin
        target = max(clamp(math.ceil(need / spare - 1e-9), self.bounds) for _, need in last)
        if target >= current:
            return None
        return Decision("scale_in", target, self._why(last, target), self._evidence(last))

    def _why(self, last: list[tuple[RolloutPhase, float]], target: int) -> str:
        needs = ", ".join(f"{need:.2f}" for _, need in last)
        config = self.config
        if last[-1][0].busy_s is not None:
            measure = "engine-busy seconds over the trainer's own seconds"
        elif config.target_phase_s is not None:
            measure = f"phase seconds at a target of {config.target_phase_s:g} s"
        else:
            measure = f"requests at {config.target_queue_per_engine:g} per engine"
        return f"the last {len(last)} rollout phases needed {needs} engines ({measure}): {target}"

    @staticmethod
    def _evidence(last: list[tuple[RolloutPhase, float]]) -> dict[str, Any]:
        return {
            "phases": [
                {
                    "seconds": round(phase.seconds, 3),
                    "requests": phase.requests,
                    "engines": phase.engines,
                    "busy_s": phase.busy_s,
                    "waited_s": phase.waited_s,
                    "need": round(need, 3),
                }
                for phase, need in last
            ]
        }
