"""Teacher and genrm engines that come back (``fault_tolerance`` of the teacher or genrm role).

Their head ranks restart a dead server as they do a rollout engine's (``EngineRestarts``), which
counts ``engine_down/<role>/<index>`` when a restart begins and ``engine_up/<role>/<index>``
when the server is ready again in the job's store. These engines serve their starting weights,
so nothing has to reach them first: rank 0's ``StaticMembership`` thread reads the counts every
``interval_s`` and takes an engine out of routing while it restarts and back as soon as it is
ready. An engine the controller found gone though its server never restarted (it stopped
answering, ``inference/health.py``) comes back once it answers ``/health`` again. Meanwhile the
controller sends what the engine lost to another one (``inference/inprocess.py``), or, with none
left, its requests wait for one (``inference/outage.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from relax_launch.console import operator_log
from relax_launch.inference.discovery import WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.manager import InferenceManager
from relax_launch.runtime.engine_restart import (
    MAX_RESTARTS,
    PROBE_S,
    engine_alive,
    restart_count,
)

log = logging.getLogger(__name__)
INTERVAL_S = 0.5  # how often the counts are read: a restart takes seconds at the least


class StaticMembership:
    """Rank 0: which engines of the fault-tolerant static roles are in routing."""

    def __init__(
        self,
        store: Any,
        managers: list[InferenceManager],
        alive: Callable[[str], bool] | None = None,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.store, self.managers, self.interval_s = store, managers, interval_s
        # whether a lost engine at this URL answers again (one probe, SGLang's own bound)
        self.alive = alive or (lambda url: engine_alive(url, PROBE_S))
        self.up: dict[tuple[str, int], int] = {}  # restarts taken back, per (role, engine)
        self.out_since: dict[tuple[str, int], float] = {}  # out of routing since (monotonic)
        self.restarts = {manager.role: 0 for manager in managers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relax-static-roles", daemon=True)

    @classmethod
    def started(cls, store: Any, managers: dict[str, InferenceManager]) -> StaticMembership | None:
        """The membership of ``managers``' fault-tolerant static roles, running (its thread
        started), or None without any."""
        tolerant = [
            m
            for m in managers.values()
            if m.fault_tolerant and m.weight_source is WeightSource.STATIC
        ]
        if not tolerant:
            return None
        membership = cls(store, tolerant)
        membership.start()
        return membership

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=PROBE_S + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the store went with the job: it is ending
                log.debug("static roles' membership not read: %s", exc)

    def poll(self) -> None:
        """Read every engine's counts once; route it out or back accordingly."""
        for manager in self.managers:
            for engine in list(manager.engines):  # a scale-out or scale-in may change them
                self._check(manager, engine)

    def _check(self, manager: InferenceManager, engine: EngineHandle) -> None:
        key = (manager.role, engine.index or 0)
        down, up = (restart_count(self.store, event, *key) for event in ("down", "up"))
        if down > up:
            manager.engine_lost(engine.engine_id, "its server is restarting")
        elif up > self.up.get(key, 0):  # even one never seen lost: its server is new
            self.restarts[manager.role] += up - self.up.get(key, 0)
            self.up[key] = up
            self._back(manager, engine, f"restarted, {up} of {MAX_RESTARTS} restarts")
        elif engine.engine_id in manager.lost and self.alive(engine.url):
            self._back(manager, engine, "it answers /health again")
        if engine.engine_id in manager.lost:
            self.out_since.setdefault(key, time.monotonic())

    def _back(self, manager: InferenceManager, engine: EngineHandle, how: str) -> None:
        manager.engine_back(engine.engine_id)
        since = self.out_since.pop((manager.role, engine.index or 0), None)
        out = f", {time.monotonic() - since:.1f} s out of routing" if since is not None else ""
        operator_log().warning(
            f"relax-launch: {manager.role} engine {engine.index} serves again ({how}{out})"
        )

    def metrics(self) -> dict[str, float]:
        """Per role: engines in routing and restarts taken back."""
        out = {}
        for manager in self.managers:
            out[f"{manager.role}/engines_serving"] = float(len(manager.serving()))
            out[f"{manager.role}/engine_restarts"] = float(self.restarts[manager.role])
        return out
