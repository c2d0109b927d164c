"""RouterWorkers: which rollout engines sglang-router routes to, changed through its own API.

In route mode ``router`` the rollout manager (``InferenceManager``) keeps the router's worker
list equal to the engines it routes: an engine is added when a weight sync commits on it (a
scaled-out or restarted engine, the moment direct mode routes it: the model is closed while the
sync runs, so no request reaches the router before the add has taken) and removed when it
leaves routing (a scale-in's engine before it is stopped, a dead or restarting engine as soon as
rank 0 hears of it), so the router never sends a request to an engine that does not hold the
version being served. sglang-router (0.3) registers and removes workers in the background:
``POST /workers {"url": ...}`` and ``DELETE /workers/{id}`` answer 202 at once, and
``GET /workers`` says when a change has taken (listed and healthy, or gone). A request in flight
on a removed worker still runs to its end; one whose engine dies under it the router sends to
another worker itself (it retries a dropped connection).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from relax_launch import http
from relax_launch.console import operator_log
from relax_launch.deadline import wait_until
from relax_launch.inference.engine import EngineHandle

CHANGE_TIMEOUT_S = 30.0  # a worker's registration: the router checks its health first
CALL_S = 10.0  # one request to the router's API


class RouterError(RuntimeError):
    """The router did not take a change of its worker list in time."""


class RouterWorkers:
    """The router at ``url`` and the worker URLs registered with it (``registered``), changed
    one at a time (thread-safe)."""

    def __init__(
        self, url: str, registered: Iterable[str], timeout_s: float = CHANGE_TIMEOUT_S
    ) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.registered = set(registered)
        self._lock = threading.Lock()

    def listed(self) -> dict[str, dict[str, Any]]:
        """The router's workers now, by URL (each with its ``id`` and ``is_healthy``)."""
        reply = http.call("GET", self.url + "/workers", timeout_s=CALL_S).raise_for_status()
        return {worker["url"]: worker for worker in reply.json()["workers"]}

    def remove(self, url: str) -> None:
        """Unregister ``url`` (nothing if it is not registered) and wait until the router no
        longer lists it: no new request goes there from then on."""
        with self._lock:
            self._remove(url)

    def match(self, wanted: Callable[[], Iterable[EngineHandle]]) -> list[EngineHandle]:
        """Make the registered workers the engines ``wanted()`` (read under the lock, so a
        concurrent removal is never undone): remove the others, then add the missing ones.
        Returns the engines that failed to register (left out of the list)."""
        with self._lock:
            engines = {engine.url: engine for engine in wanted()}
            for url in sorted(self.registered - engines.keys()):
                self._remove(url)
            failed = []
            for url in sorted(engines.keys() - self.registered):
                try:
                    self._add(url)
                except RouterError as exc:
                    operator_log().warning(f"relax-launch: {exc}; it stays out of routing")
                    failed.append(engines[url])
            return failed

    def _add(self, url: str) -> None:
        http.call("POST", self.url + "/workers", json={"url": url}, timeout_s=CALL_S)
        healthy = wait_until(
            lambda: self.listed().get(url, {}).get("is_healthy"), self.timeout_s, 0.05, 0.5
        )
        if not healthy:
            self._remove(url, force=True)
            raise RouterError(
                f"sglang-router at {self.url} did not list {url} as a healthy worker within "
                f"{self.timeout_s:.0f} s"
            )
        self.registered.add(url)
        operator_log().info(f"relax-launch: sglang-router routes to {url}")

    def _remove(self, url: str, force: bool = False) -> None:
        if url not in self.registered and not force:
            return
        worker = self.listed().get(url)
        if worker is not None:
            http.call("DELETE", f"{self.url}/workers/{worker['id']}", timeout_s=CALL_S)
            if not wait_until(lambda: url not in self.listed(), self.timeout_s, 0.05, 0.5):
                raise RouterError(
                    f"sglang-router at {self.url} still lists {url} {self.timeout_s:.0f} s "
                    "after it was removed"
                )
        if url in self.registered:
            self.registered.discard(url)
            operator_log().info(f"relax-launch: sglang-router no longer routes to {url}")
