"""RequestCounts: the requests each engine has in flight and has answered, as the gateway and
the controller's engine clients send them (a scale-in waits for an engine's in-flight requests;
``relax-launch top`` and the scale routes show both)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

THROUGH_ROUTER = "sglang-router"  # no engine id has this form (theirs are model/index)


class RequestCounts:
    """Thread-safe counts by engine id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._answered: dict[str, int] = {}
        self.regenerated = 0  # requests lost on an engine that died (or was scaled in), sent again

    @contextlib.contextmanager
    def track(self, engine_id: str | None) -> Iterator[None]:
        """Count one request to ``engine_id`` (None: through sglang-router, which picks the
        engine: counted in the role's total only) while it is in flight; answered once it
        returns (an error status is an answer, a dropped request is not)."""
        engine_id = THROUGH_ROUTER if engine_id is None else engine_id
        with self._lock:
            self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + 1
        answered = False
        try:
            yield
            answered = True
        finally:
            with self._lock:
                self._in_flight[engine_id] -= 1
                self._answered[engine_id] = self._answered.get(engine_id, 0) + answered

    def regenerating(self) -> None:
        """One request lost with its engine goes to another: generated again from its start."""
        with self._lock:
            self.regenerated += 1

    def restart(self, engine_id: str) -> None:
        """A new server behind ``engine_id``: its answers count from 0."""
        with self._lock:
            self._answered[engine_id] = 0

    def in_flight(self, engine_id: str | None = None) -> int:
        """Requests in flight to one engine, or to all of them."""
        with self._lock:
            if engine_id is not None:
                return self._in_flight.get(engine_id, 0)
            return sum(self._in_flight.values())

    def answered(self, engine_id: str) -> int:
        """Requests the engine's current server has answered so far."""
        with self._lock:
            return self._answered.get(engine_id, 0)
