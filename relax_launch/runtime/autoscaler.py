"""Autoscaler: an elastic role's engines follow its load (``{role}.autoscale``).

Every ``interval_s`` on rank 0 it reads the load: the requests the role's serving engines report
queued and running (SGLang's ``/metrics``) or, when larger, the requests the gateway and the
controller have in flight to them. It wants ``ceil(load / target_queue_per_engine)`` engines,
kept within ``min_engines`` and ``max_engines``. Once it has wanted more engines for
``scale_up_window_s`` (fewer for ``scale_down_window_s``) it asks the ``EngineScaler`` for that
many, as the API would; nothing is decided while an operation runs, nor for ``cooldown_s``
after one ended. Each decision (with the load it saw, and the operation's id or why it was
refused) is a line of ``autoscaler.jsonl`` in the run directory; the step metrics carry the
count wanted and the decisions so far.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relax_launch.inference.config import AutoscaleConfig
from relax_launch.inference.engine_load import engine_load
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused


@dataclass(frozen=True)
class Load:
    """One reading of a role's load."""

    queued: float  # waiting in the engines
    running: float  # being generated
    in_flight: int  # sent by the gateway and the controller, unanswered

    @property
    def requests(self) -> float:
        return max(self.queued + self.running, float(self.in_flight))


class Autoscaler:
    """One elastic role's autoscaler; ``start`` runs it on a daemon thread."""

    def __init__(
        self,
        role: str,
        config: AutoscaleConfig,
        bounds: tuple[int, int],
        scaler: Any,
        manager: InferenceManager,
        log_path: Path,
    ) -> None:
        self.role, self.config, self.bounds = role, config, bounds
        self.scaler, self.manager, self.log_path = scaler, manager, log_path
        self.wanted: int | None = None  # engines wanted at the last reading
        self.since: tuple[str, float] | None = None  # (direction, since when it is wanted)
        self.decisions = 0
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

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            if self.manager.ready:  # not while it starts, syncs or failed
                self.tick(self.read(), time.monotonic())

    def read(self) -> Load:
        queued = running = 0.0
        for engine in self.manager.serving():
            load = engine_load(engine.url)
            if load is not None:
                queued, running = queued + load.queued, running + load.running
        return Load(queued, running, self.manager.requests.in_flight())

    def tick(self, load: Load, now: float) -> dict[str, Any] | None:
        """One reading: the decision taken (also logged), or None."""
        low, high = self.bounds
        target = self.config.target_queue_per_engine
        self.wanted = min(max(math.ceil(load.requests / target), low), high)
        current = self.scaler.count(self.role)
        ended = self.scaler.ended.get(self.role)
        cooling = ended is not None and now - ended < self.config.cooldown_s
        if self.role in self.scaler.active or cooling or self.wanted == current:
            self.since = None
            return None
        direction = "scale_out" if self.wanted > current else "scale_in"
        if self.since is None or self.since[0] != direction:
            self.since = (direction, now)
        window = self.config.scale_up_window_s if direction == "scale_out" else (
            self.config.scale_down_window_s
        )  # fmt: skip
        if now - self.since[1] < window:
            return None
        self.since = None
        decision = {
            "time": time.time(),
            "role": self.role,
            "decision": direction,
            "from": current,
            "to": self.wanted,
            "load": asdict(load),
        }
        try:
            op = self.scaler.request(self.role, direction, self.wanted, source="autoscaler")
            decision["request_id"] = op.request_id
        except ScaleRefused as exc:
            decision["refused"] = str(exc)
        self.decisions += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(json.dumps(decision) + "\n")
        return decision

    def metrics(self) -> dict[str, float]:
        out = {f"{self.role}/autoscale_decisions": float(self.decisions)}
        if self.wanted is not None:
            out[f"{self.role}/autoscale_wanted"] = float(self.wanted)
        return out
