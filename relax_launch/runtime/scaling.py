# long: one scale operation's lifecycle (start, health, sync, commit, cancel, undo, drain)
"""EngineScaler: rank 0 starts and stops the reserved engines of an elastic role (``max_engines``)
while the job runs, for the gateway's scale routes and the autoscaler.

A scale-out asks each chosen reserved engine's head rank to start its server (``StartEngine``:
it answers once the server has generated a token), checks ``/health`` and only then puts it in
routing; a rollout engine joins the next weight sync first (``RolloutMembership``) and is routed
once that sync has committed on it, so it never serves an older version. If any engine fails to
start, those that started are stopped again: the count stays as it was and the operation says
why. A scale-in takes the newest scaled-out engines out of routing, waits (bounded) until what
they were sent is answered and the engine reports nothing queued or running, then has the head
rank stop the server by its PID (``StopEngine``); a request still in flight then fails at the
stopped engine and the gateway and the controller send it to another engine (``was_retired``).
A rollout engine is never stopped while a weight sync runs (``WeightSync.lock``).

One operation per role at a time; the planned engines are never stopped.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from relax_launch.console import operator_log
from relax_launch.deadline import Deadline
from relax_launch.inference.discovery import PoolRecord
from relax_launch.inference.engine import EngineHandle, get_json
from relax_launch.inference.engine_load import idle
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.placement.plan import EnginePlan, PlacementPlan
from relax_launch.runtime import scale_admission as admission
from relax_launch.runtime import scale_views
from relax_launch.runtime.control import REPLY_MARGIN_S, Command
from relax_launch.runtime.rank_commands import StartEngine, StopEngine
from relax_launch.runtime.scale_records import (
    Cancelled,
    Replica,
    ScaleOperation,
    log_operation,
)

HISTORY = 256  # operations kept for their status routes
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1
Call = Callable[[Command, list[int], float], dict[int, Any]]


class EngineScaler:
    """See the module docstring. Thread-safe; each operation runs on its own thread."""

    def __init__(
        self,
        *,
        plan: PlacementPlan,
        managers: dict[str, InferenceManager],
        call: Call,
        startup_timeout_s: float,
        drain_timeout_s: float,
        sync_lock: threading.Lock,
        log_dir: Path,
    ) -> None:
        self.plan, self.managers, self._call = plan, managers, call
        self.startup_timeout_s, self.drain_timeout_s = startup_timeout_s, drain_timeout_s
        self.sync_lock, self.log_dir = sync_lock, log_dir
        self.roles = {
            role: self.plan.engines_of(role)
            for role in managers
            if any(e.reserved for e in self.plan.engines_of(role))
        }
        self.operations: OrderedDict[str, ScaleOperation] = OrderedDict()
        self.active: dict[str, ScaleOperation] = {}
        self.running: dict[str, set[int]] = {role: set() for role in self.roles}  # scaled out
        self.finished = dict.fromkeys(self.roles, 0)  # operations ended, per role
        self.ended: dict[str, float] = {}  # when the role's last operation ended (monotonic)
        self.succeeded: dict[tuple[str, str], ScaleOperation] = {}  # newest, by (role, kind)
        self.closed = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # ---- what the routes ask -------------------------------------------------------------

    def count(self, role: str) -> int:
        """The role's engines counted towards a target: the planned ones and the scaled-out
        ones started or starting."""
        planned = sum(not e.reserved for e in self.roles[role])
        return planned + len(self.running[role])

    def actual(self, role: str) -> int:
        """The role's engines serving now (routed: not starting, syncing, draining or lost)."""
        return len(self.managers[role].serving())

    def bounds(self, role: str) -> tuple[int, int]:
        """(planned, max_engines) of ``role``."""
        return sum(not e.reserved for e in self.roles[role]), len(self.roles[role])

    def request(
        self,
        role: str,
        kind: str,
        target: int,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        source: str = "api",
    ) -> ScaleOperation:
        """Start an operation towards ``target`` engines in total; raises ``ScaleRefused``."""
        with self._lock:
            self._check(role, kind, target, model, timeout_s)
            manager = self.managers[role]
            picks = self._picks(role, kind, target)
            op = ScaleOperation(
                request_id=uuid.uuid4().hex[:16],
                role=role,
                kind=kind,
                before=self.count(role),
                target=target,
                timeout_s=timeout_s or self._default_timeout(role, kind),
                source=source,
                replicas=[Replica(e.index, f"{manager.model_id}/{e.index}") for e in picks],
            )
            self.operations[op.request_id] = op
            while len(self.operations) > HISTORY:
                self.operations.popitem(last=False)
            self.active[role] = op
            if kind == "scale_out":  # counted from now: a later request sees the target
                self.running[role] |= {e.index for e in picks}
        thread = threading.Thread(
            target=self._run, args=(op, picks), name=f"relax-{kind}", daemon=True
        )
        self._threads.append(thread)
        thread.start()
        return op

    def get(self, role: str, kind: str, request_id: str) -> ScaleOperation | None:
        op = self.operations.get(request_id)
        return op if op is not None and (op.role, op.kind) == (role, kind) else None

    def listed(self, role: str, kind: str) -> list[ScaleOperation]:
        """The role's operations of ``kind`` kept (the last ``HISTORY``), newest first."""
        with self._lock:
            ops = [op for op in self.operations.values() if (op.role, op.kind) == (role, kind)]
        return ops[::-1]

    def cancel(self, role: str, request_id: str) -> ScaleOperation:
        """Ask a scale-out in flight to stop: a start under way ends first (its head rank
        answers nothing else meanwhile), then every engine it started is stopped by PID and
        the count is as before; a cancel accepted always ends ``cancelled``. Raises
        ``ScaleRefused``: 404 unknown, 409 already ended or committed (``_commit``)."""
        op = self.get(role, "scale_out", request_id)
        if op is None:
            raise ScaleRefused(404, f"{role} has no scale_out operation {request_id!r}")
        with self._lock:
            if op.finished is not None or op.state not in ("running", "cancelling"):
                raise ScaleRefused(409, f"scale_out {request_id} already ended: {op.state}")
            if op.committed:
                raise ScaleRefused(
                    409,
                    f"scale_out {request_id} is too late to cancel: its engines serve "
                    f"(or are being routed); scale {role} in instead",
                )
            op.cancel.set()
            op.state = "cancelling"
        return op

    def replicas(self, role: str) -> list[dict[str, Any]]:
        """Every engine of ``role`` in the plan: its state, URL and requests in flight."""
        return scale_views.replicas(self, role)

    def pool(self) -> PoolRecord | None:
        """The shared spare pool: its ranks and the engines holding them (None: no pool)."""
        return scale_views.pool(self)

    def scaling(self, role: str) -> dict[str, Any]:
        """``replicas``, and the ``operation`` in flight (None when there is none)."""
        active = self.active.get(role)
        operation = active.document(self.actual(role)) if active is not None else None
        return {"replicas": self.replicas(role), "operation": operation}

    def metrics(self) -> dict[str, float]:
        """Step metrics: each elastic role's engines and operations so far."""
        out = {}
        for role in self.roles:
            out[f"{role}/engines"] = float(self.count(role))
            out[f"{role}/scale_operations"] = float(self.finished[role])
        return out

    def close(self) -> None:
        """Refuse new operations and let those in flight end, each within its own bound: a
        head rank starting an engine answers no other command (the job's stop) until then."""
        with self._lock:
            self.closed = True
            running = list(self.active.values())
        left = [op.started + op.timeout_s + REPLY_MARGIN_S - time.time() for op in running]
        for op, seconds in zip(running, left, strict=True):
            operator_log().warning(
                f"relax-launch: waiting up to {seconds:.0f} s for the {op.role} {op.kind} in "
                "flight to end"
            )
        deadline = Deadline(max(left, default=0.0))
        for thread in self._threads:
            thread.join(timeout=max(deadline.left(), 0.1))

    # ---- checks --------------------------------------------------------------------------

    def _check(
        self, role: str, kind: str, target: int, model: str | None, timeout_s: float | None
    ) -> None:
        if self.closed:
            raise ScaleRefused(409, f"{kind} refused: the job is stopping")
        if role not in self.roles:
            raise ScaleRefused(400, f"{role} has no reserved engines: set {role}.max_engines")
        active = self.active.get(role)
        admission.check_request(role, self.managers[role], kind, target, model, timeout_s, active)
        admission.check_target(role, kind, target, self.count(role), self.bounds(role))
        if kind == "scale_out":  # on the spare pool, another role may hold the ranks
            free, held = self._picks(role, kind, target), map(self.holder, self.roles[role])
            admission.check_pool_room(role, len(free), target - self.count(role), held)

    def _picks(self, role: str, kind: str, target: int) -> list[EnginePlan]:
        """The reserved engines to start (lowest first), or the scaled-out ones to stop
        (newest first)."""
        reserved = [e for e in self.roles[role] if e.reserved]
        if kind == "scale_out":
            free = [e for e in reserved if e.index not in self.running[role] and not self.holder(e)]
            return free[: target - self.count(role)]
        started = [e for e in reversed(reserved) if e.index in self.running[role]]
        return started[: self.count(role) - target]

    def holder(self, engine: EnginePlan) -> str | None:
        """The engine of another role on ``engine``'s ranks (the shared spare pool's)."""
        return scale_views.holder(self, engine)

    def _default_timeout(self, role: str, kind: str) -> float:
        if kind == "scale_in":  # what is left at the bound is generated again elsewhere
            return self.drain_timeout_s
        # a rollout engine also waits for the next weight sync before it is routed
        return self.startup_timeout_s * (2 if role == "rollout" else 1)

    # ---- the operations ------------------------------------------------------------------

    def _run(self, op: ScaleOperation, picks: list[EnginePlan]) -> None:
        state, error = "failed", "interrupted"
        try:
            if op.kind == "scale_out":
                self._scale_out(op, picks)
            else:
                self._scale_in(op, picks)
            state, error = "succeeded", ""
        except Cancelled as exc:
            state, error = "cancelled", str(exc)
        except Exception as exc:  # noqa: BLE001 - the operation's answer, not the job's end
            state, error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            with self._lock:  # with cancel's check: a cancel answered 202 never ends "failed"
                if op.cancel.is_set() and state == "failed":
                    state = "cancelled"  # its failure undid the engines, as a cancel does
                op.state, op.error, op.finished = state, error, time.time()
                self.active.pop(op.role, None)
                self.finished[op.role] += 1
                self.ended[op.role] = time.monotonic()
                if op.state == "succeeded":
                    self.succeeded[(op.role, op.kind)] = op
            log_operation(op, self.actual(op.role), self.log_dir)

    def _scale_out(self, op: ScaleOperation, picks: list[EnginePlan]) -> None:
        deadline = Deadline(op.timeout_s)
        manager = self.managers[op.role]
        with ThreadPoolExecutor(max_workers=len(picks)) as pool:
            starts = list(pool.map(self._start, op.replicas, picks, [deadline] * len(picks)))
        self._stop_if_cancelled(op, picks)
        failed = [r for r in op.replicas if r.state == "failed"]
        if failed:  # stop them all: one may fail its health check with its server up
            self._undo(op, picks, "another engine of this scale-out failed")
            raise RuntimeError(
                f"{len(failed)} of {len(picks)} engines failed to start, so none was added ("
                + "; ".join(f"engine {r.index}: {r.error.splitlines()[0]}" for r in failed)
                + f"); {op.role} keeps {op.before} engines"
            )
        joining = op.role == "rollout"
        if not joining:  # routed at once: a cancel after this is too late
            self._commit(op, picks)
        with self.sync_lock if joining else contextlib.nullcontext():
            for replica, handle in zip(op.replicas, starts, strict=True):
                manager.add_engine(handle, joining=joining)
                replica.state = "weight_syncing" if joining else "serving"
        if joining:
            self._wait_routed(op, manager, starts, picks, deadline)

    def _commit(self, op: ScaleOperation, picks: list[EnginePlan]) -> None:
        """The scale-out's point of no return: a cancel asked before it is honoured now (the
        engines stopped, ``Cancelled``), one asked after it is refused 409 (``cancel``), so a
        202 ``cancelling`` never ends ``succeeded``."""
        with self._lock:
            op.committed = not op.cancel.is_set()
        self._stop_if_cancelled(op, picks)

    def _stop_if_cancelled(self, op: ScaleOperation, picks: list[EnginePlan]) -> None:
        """A cancelled scale-out: its engines stopped again, the operation ends ``Cancelled``."""
        if op.cancel.is_set():
            self._undo(op, picks, "the scale-out was cancelled")
            raise Cancelled(
                f"cancelled; the engines it started were stopped, {op.role} keeps {op.before}"
            )

    def _undo(self, op: ScaleOperation, picks: list[EnginePlan], why: str) -> None:
        """A scale-out that failed: stop every engine it started, the count is as before. A
        rollout engine is stopped only between weight syncs (one may have admitted it). One
        stop failing does not keep the others up, nor the stopped ones counted."""
        manager, stopped, errors = self.managers[op.role], set(), []
        with self.sync_lock if op.role == "rollout" else contextlib.nullcontext():
            routed = {e.engine_id for e in manager.engines}
            for replica, engine in zip(op.replicas, picks, strict=True):
                if replica.engine_id in routed:  # what it was sent goes to another engine
                    manager.retire(replica.engine_id)
                try:
                    self._stop(engine, replica, why=why)
                    stopped.add(engine.index)
                except Exception as exc:  # noqa: BLE001 - raised below, once all were tried
                    errors.append(f"{engine.label}: {type(exc).__name__}: {exc}")
        with self._lock:
            self.running[op.role] -= stopped
        if errors:
            raise RuntimeError(f"{why}, but stopping failed for " + "; ".join(errors))

    def _start(
        self, replica: Replica, engine: EnginePlan, deadline: Deadline
    ) -> EngineHandle | None:
        began = time.monotonic()
        replica.state = "starting"
        try:
            left = deadline.left(f"starting {engine.label}")
            command = StartEngine(engine.role, engine.index, left)
            url = self._call(command, [engine.head_rank], left + REPLY_MARGIN_S)[engine.head_rank]
            replica.state, replica.url = "health_checking", url
            get_json(url, "/health", 10.0)  # routable only once its health check passes
        except Exception as exc:  # noqa: BLE001 - recorded, and the scale-out undone
            replica.state, replica.error = "failed", f"{type(exc).__name__}: {exc}"
            replica.seconds = time.monotonic() - began
            return None
        replica.url, replica.seconds = url, time.monotonic() - began
        static = engine.role != "rollout"
        return EngineHandle(
            replica.engine_id, url, role=engine.role, static=static, index=engine.index
        )

    def _wait_routed(
        self,
        op: ScaleOperation,
        manager: InferenceManager,
        handles: list[EngineHandle],
        picks: list[EnginePlan],
        deadline: Deadline,
    ) -> None:
        """A rollout engine is routed once a weight sync committed on it: wait for that."""
        while True:
            serving = {e.engine_id for e in manager.serving()}
            if manager.ready and all(h.engine_id in serving for h in handles):
                self._commit(op, picks)  # a cancel since the sync routed them: stopped again
                break
            self._stop_if_cancelled(op, picks)  # its undo waits for a sync under way
            if deadline.passed:
                self._undo(op, picks, "no weight sync took it in time")
                raise TimeoutError(
                    f"no weight sync committed on the new rollout engines within "
                    f"{op.timeout_s:.0f} s (timeout_secs); they were stopped again"
                )
            time.sleep(POLL_S)
        for replica in op.replicas:
            replica.state = "serving"

    def _scale_in(self, op: ScaleOperation, picks: list[EnginePlan]) -> None:
        manager = self.managers[op.role]
        deadline = Deadline(op.timeout_s)
        for replica in op.replicas:
            manager.retire(replica.engine_id)
            replica.state = "draining"
        for replica, engine in zip(op.replicas, picks, strict=True):
            self._drain(manager, replica, deadline)
            with self.sync_lock if op.role == "rollout" else contextlib.nullcontext():
                self._stop(engine, replica)
            with self._lock:
                self.running[op.role].discard(engine.index)

    def _drain(self, manager: InferenceManager, replica: Replica, deadline: Deadline) -> None:
        """Until what the engine was sent is answered and it reports nothing queued or running,
        or the deadline: what is left then goes to another engine when the server stops."""
        began = time.monotonic()
        url = next((e.url for e in manager.engines if e.engine_id == replica.engine_id), None)
        while not deadline.passed:
            if manager.requests.in_flight(replica.engine_id) == 0 and idle(url):
                break
            time.sleep(POLL_S)
        replica.rerouted = manager.requests.in_flight(replica.engine_id)
        replica.seconds = time.monotonic() - began

    def _stop(self, engine: EnginePlan, replica: Replica, why: str = "") -> None:
        """Stop the engine's server (its head rank, by PID) and forget it."""
        self._call(StopEngine(engine.role, engine.index), [engine.head_rank], STOP_TIMEOUT_S)
        self.managers[engine.role].remove_engine(replica.engine_id)
        if replica.state != "failed":
            replica.state = "stopped"
            replica.error = why
