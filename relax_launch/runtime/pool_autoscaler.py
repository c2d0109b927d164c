"""The shared spare pool's autoscaler (``cluster.spare_autoscale``): the shell around
``PoolPolicy`` (``runtime/pool_policy.py``). Every ``interval_s``, on a daemon thread on rank 0,
it reads each pool role's demand (the requests its serving engines report queued and running,
or the requests in flight to them when more; the requests answered so far; whether a rollout
phase runs, from ``Session.rollout_phase``) and the pool's free ranks, and asks the
``EngineScaler`` for the policy's moves as the API would. The engines of every role are read
at once within one bound (``autoscaler.LoadReader``), the pool's holders from the scaler's one
answer (``EngineScaler.pool``). A role's start cost is ``start_estimate_s`` until a scale-out of
it has measured one (a rollout engine's first weight sync included; the scaler's index of its
newest succeeded operation, ``EngineScaler.succeeded``).

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

from relax_launch.inference.discovery import PoolRecord
from relax_launch.inference.manager import InferenceManager
from relax_launch.placement.config import SpareAutoscaleConfig
from relax_launch.rl.interfaces import RolloutWork
from relax_launch.runtime.autoscale_policy import Load
from relax_launch.runtime.autoscaler import LoadReader, request_and_log
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
        self.start_s = dict.fromkeys(self.roles, config.start_estimate_s)
        self.in_phase = False  # a rollout phase runs
        self.decisions = 0
        self.reader = LoadReader()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relax-pool-autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.reader.close()

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
        """What the policy sees now (every pool role's engines read at once)."""
        read = self.reader.read({role: self.managers[role] for role in self.roles})
        pool = self.scaler.pool()
        roles = tuple(self._role(role, read[role], pool) for role in self.roles)
        loads = {r.role: r.outstanding for r in roles}
        waiting = "rollout" if self.in_phase else max(loads, key=loads.get, default=None)
        free = len(pool.free_ranks) if pool is not None else 0
        return PoolView(now, free, roles, waiting if loads.get(waiting) else None)

    def tick(self, view: PoolView) -> list[dict[str, Any]]:
        """One reading: the decisions taken (each also logged)."""
        return [self._act(move, view) for move in self.policy.decide(view)]

    def metrics(self) -> dict[str, float]:
        pool = self.scaler.pool()
        out = {"pool/autoscale_decisions": float(self.decisions)}
        out["pool/free_ranks"] = float(len(pool.free_ranks) if pool is not None else 0)
        for role in self.roles:
            out[f"{role}/pool_engines"] = float(_held(pool, role))
        return out

    # ---- readings ------------------------------------------------------------------------

    def _role(self, role: str, load: Load, pool: PoolRecord | None) -> RoleView:
        manager, scaler = self.managers[role], self.scaler
        measured = scaler.succeeded.get((role, "scale_out"))  # the newest start measured
        if measured is not None and measured.finished is not None:
            self.start_s[role] = measured.finished - measured.started
        width = next(len(e.ranks) for e in scaler.roles[role] if e.pool)
        return RoleView(
            role=role,
            width=width,
            engines=scaler.count(role),
            serving=len(manager.serving()),
            held=_held(pool, role),
            most=scaler.bounds(role)[1],
            outstanding=load.requests,
            answered=float(sum(manager.requests.answered(e.engine_id) for e in manager.engines)),
            start_s=self.start_s[role],
            busy=role in scaler.active,
            phase=role == "rollout" and self.in_phase,
        )

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
        record = request_and_log(self.scaler, record, self.log_path)
        if "refused" not in record:  # the policy learns only the moves the scaler took
            self.policy.accepted(move, view.now)
        return record


def _held(pool: PoolRecord | None, role: str) -> int:
    """The pool engines ``role`` holds (started or starting)."""
    return sum(e.role == role for e in pool.engines) if pool is not None else 0


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
