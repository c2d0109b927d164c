"""The shared spare pool's autoscaler (``cluster.spare_autoscale``): the shell around
``PoolPolicy`` (``runtime/pool_policy.py``). Every ``interval_s``, on a daemon thread on rank 0,
it reads each pool role's demand (the requests its serving engines report queued and running,
or the requests in flight to them when more; the requests answered so far; whether a rollout
phase runs, from ``Session.rollout_phase``) and the pool's free ranks, and asks the
``EngineScaler`` for the policy's moves as the API would. A role's start cost is
``start_estimate_s`` until a scale-out of it has measured one (a rollout engine's first weight
sync included).

Each decision (what it saw of every role, why, and the operation's id or why it was refused)
is a line of ``autoscaler.jsonl`` in the run directory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relax_launch.inference.engine_load import engine_load
from relax_launch.inference.manager import InferenceManager
from relax_launch.placement.config import SpareAutoscaleConfig
from relax_launch.rl.interfaces import RolloutWork
from relax_launch.runtime.autoscaler import request_and_log
from relax_launch.runtime.pool_policy import (
    Move,
    PoolPolicy,
    PoolPolicyConfig,
    PoolView,
    RoleView,
)
from relax_launch.runtime.scaling import EngineScaler


class PoolAutoscaler:
    """See the module docstring."""

    def __init__(
        self,
        config: SpareAutoscaleConfig,
        scaler: EngineScaler,
        managers: dict[str, InferenceManager],
        log_path: Path,
    ) -> None:
        self.config, self.scaler, self.managers, self.log_path = config, scaler, managers, log_path
        self.policy = PoolPolicy(
            PoolPolicyConfig(config.target_queue_per_engine, config.min_gain_s, config.hold_s)
        )
        self.roles = [r for r, engines in scaler.roles.items() if any(e.pool for e in engines)]
        self.pool_ranks = {r for e in scaler.plan.engines if e.pool for r in e.ranks}
        self.start_s = dict.fromkeys(self.roles, config.start_estimate_s)
        self.in_phase = False  # a rollout phase runs
        self.decisions = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relax-pool-autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @contextmanager
    def phase(self, requests: int) -> Iterator[RolloutWork]:
        """Around one rollout phase: the policy sees the rollout role's phase while it runs."""
        self.in_phase = True
        try:
            yield RolloutWork(requests)
        finally:
            self.in_phase = False

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            if all(self.managers[r].ready for r in self.roles):  # not while one syncs or starts
                self.tick(self.view(time.monotonic()))

    def view(self, now: float) -> PoolView:
        """What the policy sees now."""
        roles = tuple(self._role(role) for role in self.roles)
        loads = {r.role: r.outstanding for r in roles}
        waiting = "rollout" if self.in_phase else max(loads, key=loads.get, default=None)
        return PoolView(now, self._free_ranks(), roles, waiting if loads.get(waiting) else None)

    def tick(self, view: PoolView) -> list[dict[str, Any]]:
        """One reading: the decisions taken (each also logged)."""
        return [self._act(move, view) for move in self.policy.decide(view)]

    def metrics(self) -> dict[str, float]:
        out = {"pool/autoscale_decisions": float(self.decisions)}
        out["pool/free_ranks"] = float(self._free_ranks())
        for role in self.roles:
            out[f"{role}/pool_engines"] = float(self._held(role))
        return out

    # ---- readings ------------------------------------------------------------------------

    def _role(self, role: str) -> RoleView:
        manager, scaler = self.managers[role], self.scaler
        queued = running = 0.0
        for engine in manager.serving():
            load = engine_load(engine.url)
            if load is not None:
                queued, running = queued + load.queued, running + load.running
        self._measure_start(role)
        pool = next(e for e in scaler.roles[role] if e.pool)
        return RoleView(
            role=role,
            width=len(pool.ranks),
            engines=scaler.count(role),
            serving=len(manager.serving()),
            held=self._held(role),
            most=scaler.bounds(role)[1],
            outstanding=max(queued + running, float(manager.requests.in_flight())),
            answered=float(sum(manager.requests.answered(e.engine_id) for e in manager.engines)),
            start_s=self.start_s[role],
            busy=role in scaler.active,
            phase=role == "rollout" and self.in_phase,
        )

    def _held(self, role: str) -> int:
        running = self.scaler.running[role]
        return sum(e.pool and e.index in running for e in self.scaler.roles[role])

    def _free_ranks(self) -> int:
        held = {
            rank
            for role in self.roles
            for e in self.scaler.roles[role]
            if e.pool and e.index in self.scaler.running[role]
            for rank in e.ranks
        }
        return len(self.pool_ranks - held)

    def _measure_start(self, role: str) -> None:
        """The role's start cost from its newest scale-out that succeeded."""
        for op in self.scaler.listed(role, "scale_out"):  # newest first
            if op.state == "succeeded" and op.finished is not None:
                self.start_s[role] = op.finished - op.started
                return

    # ---- decisions -----------------------------------------------------------------------

    def _act(self, move: Move, view: PoolView) -> dict[str, Any]:
        record = {
            "time": time.time(),
            "policy": "spare_pool",
            "role": move.role,
            "decision": move.direction,
            "from": view.role(move.role).engines,
            "to": move.target,
            "reason": move.reason,
            "waiting_on": view.waiting_on,
            "free_ranks": view.free_ranks,
            "roles": {r.role: _seen(r) for r in view.roles},
            **move.evidence,
        }
        self.decisions += 1
        return request_and_log(self.scaler, record, self.log_path)


def _seen(role: RoleView) -> dict[str, Any]:
    return {
        "engines": role.engines,
        "serving": role.serving,
        "pool_engines": role.held,
        "outstanding": role.outstanding,
        "answered": role.answered,
        "start_s": round(role.start_s, 2),
        "phase": role.phase,
    }
