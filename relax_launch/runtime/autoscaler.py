"""Autoscalers: an elastic role's engines follow its demand (``{role}.autoscale``). Each is the
shell around a pure policy of ``runtime/autoscale_policy.py``: it reads the observations, asks
the ``EngineScaler`` for the count the policy decides (as the API would) and logs the decision.

- ``LoadAutoscaler`` (teacher, genrm): every ``interval_s``, on a daemon thread on rank 0, it
  reads the load: the requests the role's serving engines report queued and running (SGLang's
  ``/metrics``) or, when larger, the requests the gateway and the controller have in flight to
  them (``LoadPolicy``).
- ``PhaseAutoscaler`` (rollout): the RL program reports each rollout phase
  (``Session.rollout_phase``: its requests, how long it ran, with how many engines) and the
  decision is taken when the phase ends (``PhasePolicy``); nothing reads the load in between.

Each decision (with what it saw, why, and the operation's id or why it was refused) is a line of
``autoscaler.jsonl`` in the run directory; the step metrics carry the count wanted and the
decisions so far.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from relax_launch.deadline import Deadline
from relax_launch.inference.config import (
    AutoscaleConfig,
    InferenceRoleConfig,
    RolloutAutoscaleConfig,
)
from relax_launch.inference.engine_load import engine_load
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.rl.interfaces import RolloutWork
from relax_launch.runtime.autoscale_policy import (
    Decision,
    Load,
    LoadPolicy,
    PhasePolicy,
    RolloutPhase,
    Scaling,
)

log = logging.getLogger(__name__)
READERS = 16  # engines' loads read at once
READ_MARGIN_S = 1.0  # past a read's own timeout: its thread returning


class Autoscaler:
    """What every autoscaler does with a decision: ask the scaler, log it, count it."""

    policy: LoadPolicy | PhasePolicy

    def __init__(self, role: str, scaler: Any, manager: InferenceManager, log_path: Path) -> None:
        self.role, self.scaler, self.manager, self.log_path = role, scaler, manager, log_path
        self.decisions = 0

    def start(self) -> None:
        """Begin observing (a thread for the load; the phases come from the RL program)."""

    def close(self) -> None:
        """Stop observing."""

    def scaling(self) -> Scaling:
        """The scaler's view of the role, as the policies take it."""
        role = self.role
        busy = role in self.scaler.active
        return Scaling(self.scaler.count(role), busy, self.scaler.ended.get(role))

    def act(self, decision: Decision, current: int, seen: dict[str, Any]) -> dict[str, Any]:
        """Ask the scaler for the decision; the line logged (also returned)."""
        record = {
            "time": time.time(),
            "role": self.role,
            "decision": decision.direction,
            "from": current,
            "to": decision.target,
            "reason": decision.reason,
            **seen,
            **decision.evidence,
        }
        self.decisions += 1
        return request_and_log(self.scaler, record, self.log_path)

    def metrics(self) -> dict[str, float]:
        out = {f"{self.role}/autoscale_decisions": float(self.decisions)}
        if self.policy.wanted is not None:
            out[f"{self.role}/autoscale_wanted"] = float(self.policy.wanted)
        return out


class LoadAutoscaler(Autoscaler):
    """A teacher or genrm role's autoscaler; ``start`` runs it on a daemon thread."""

    def __init__(
        self,
        role: str,
        config: AutoscaleConfig,
        bounds: tuple[int, int],
        scaler: Any,
        manager: InferenceManager,
        log_path: Path,
    ) -> None:
        super().__init__(role, scaler, manager, log_path)
        self.config, self.policy = config, LoadPolicy(config, bounds)
        self.reader = LoadReader()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"relax-autoscaler-{role}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.reader.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            if self.manager.ready:  # not while it starts, syncs or failed
                self.tick(self.read(), time.monotonic())

    def read(self) -> Load:
        return self.reader.read({self.role: self.manager})[self.role]

    def tick(self, load: Load, now: float) -> dict[str, Any] | None:
        """One reading: the decision taken (also logged), or None."""
        scaling = self.scaling()
        decision = self.policy.decide(load, scaling, now)
        if decision is None:
            return None
        return self.act(decision, scaling.engines, {"load": asdict(load)})


class PhaseAutoscaler(Autoscaler):
    """The rollout role's autoscaler: fed by ``phase`` around each rollout phase."""

    def __init__(
        self,
        role: str,
        config: RolloutAutoscaleConfig,
        bounds: tuple[int, int],
        scaler: Any,
        manager: InferenceManager,
        log_path: Path,
    ) -> None:
        super().__init__(role, scaler, manager, log_path)
        self.policy = PhasePolicy(config, bounds)
        self._lock = threading.Lock()  # the one-step off-policy rollout runs on its own thread

    @contextmanager
    def phase(self, requests: int) -> Iterator[RolloutWork]:
        """Around one rollout phase of ``requests``, decided at its end; a phase that fails or
        is abandoned for a stop decides nothing."""
        work = RolloutWork(requests)
        started, engines = time.monotonic(), self._serving()
        yield work
        ended, after = time.monotonic(), self._serving()
        phase = RolloutPhase(
            started,
            ended,
            engines if engines == after else None,
            work.requests,
            work.busy_s,
            work.waited_s,
        )
        self.observe(phase)

    def observe(self, phase: RolloutPhase) -> dict[str, Any] | None:
        """One finished phase: the decision taken (also logged), or None."""
        with self._lock:
            scaling = self.scaling()
            decision = self.policy.decide(phase, scaling)
            if decision is None:
                return None
            return self.act(decision, scaling.engines, {"policy": "rollout_phase"})

    def _serving(self) -> int:
        return len(self.manager.serving())


def autoscaler_for(
    role: str,
    section: InferenceRoleConfig,
    scaler: Any,
    manager: InferenceManager,
    log_path: Path,
) -> Autoscaler:
    """The role's autoscaler: by rollout phases for the rollout role, by load for the others
    (``runtime/autoscale_policy.py`` says why)."""
    kind = PhaseAutoscaler if role == "rollout" else LoadAutoscaler
    return kind(role, section.autoscale, section.autoscale_bounds, scaler, manager, log_path)


class LoadReader:
    """Reads roles' loads, every engine of every role at once, on one pool of ``READERS``
    threads kept for the reader's life (a tick starts no thread) and ended by ``close``."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="relax-load")
        self.reads: list[Future] = []  # the last reading's (a late one may still run)

    def read(self, managers: dict[str, InferenceManager]) -> dict[str, Load]:
        """Each role's load: its serving engines' own (``/v1/loads``), the whole reading bounded
        by ``timeout_s`` (an engine that has not answered by then counts nothing), and the
        requests in flight to the role."""
        engines = [(role, e.url) for role, m in managers.items() for e in m.serving()]
        totals = {role: [0.0, 0.0] for role in managers}
        if engines:
            deadline = Deadline(self.timeout_s)
            self.reads = [self.pool.submit(engine_load, url, self.timeout_s) for _, url in engines]
            wait(self.reads, timeout=deadline.left())
            for read in self.reads:
                read.cancel()  # not started by the bound: dropped (a late reply is not waited on)
            for (role, _), read in zip(engines, self.reads, strict=True):
                load = read.result() if read.done() and not read.cancelled() else None
                if load is not None:
                    totals[role][0] += load.queued
                    totals[role][1] += load.running
        return {role: Load(*totals[role], managers[role].requests.in_flight()) for role in managers}

    def close(self) -> None:
        """End the threads: a read still running ends within its own ``timeout_s``, then they
        are joined; one that outlives its bound is logged and left to end (its thread exits
        with it), not waited on."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        _, late = wait(self.reads, timeout=self.timeout_s + READ_MARGIN_S)
        if late:
            log.warning(
                "%d engine load reads outlived their %g s bound at close", len(late), self.timeout_s
            )
            return
        self.pool.shutdown(wait=True)  # every read ended: the idle threads exit at once


def request_and_log(scaler: Any, record: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """Ask ``scaler`` for the decision in ``record`` (its role, decision and target), add the
    operation's id or the refusal, and append the record to ``log_path`` (autoscaler.jsonl)."""
    try:
        op = scaler.request(record["role"], record["decision"], record["to"], source="autoscaler")
        record["request_id"] = op.request_id
    except ScaleRefused as exc:
        record["refused"] = str(exc)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        log.write(json.dumps(record) + "\n")
    return record
