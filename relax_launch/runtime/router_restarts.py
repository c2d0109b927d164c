"""RouterRestarts: behind sglang-router, a restarting rollout engine leaves its workers at once.

In route mode ``router`` the router, not the controller, picks the engine of each request, and
it sends a request that finds its engine dead to another worker itself, so the controller never
sees the death (in direct mode its first failed request takes the engine out of routing). The
engine's head rank restarts the server (``EngineRestarts``), and the new server answers with the
weights it loaded from disk, not the version being served. So rank 0 reads the heads' restart
counts (``engine_down/rollout/<index>``) every ``interval_s`` on a thread of its own and takes a
restarting engine out of routing, which removes it from the router's workers
(``InferenceManager.engine_lost``): a read every 0.25 s against a server that needs seconds to
load. ``RolloutMembership`` brings it back into the next weight sync, and the router routes to
it again once that sync commits.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from relax_launch.inference.manager import InferenceManager
from relax_launch.runtime.engine_restart import restart_count

log = logging.getLogger(__name__)
INTERVAL_S = 0.25  # a relaunched SGLang server needs seconds before it answers


class RouterRestarts:
    """Rank 0's thread that takes restarting rollout engines out of the router."""

    def __init__(self, store: Any, manager: InferenceManager, interval_s: float = INTERVAL_S):
        self.store, self.manager, self.interval_s = store, manager, interval_s
        self.down: dict[int, int] = {}  # restarts begun, per engine, as last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relax-router-restarts", daemon=True)

    @classmethod
    def started(cls, store: Any, manager: InferenceManager | None) -> RouterRestarts | None:
        """Running for a fault-tolerant rollout role behind sglang-router; else None."""
        if manager is None or manager.router is None or not manager.fault_tolerant:
            return None
        watch = cls(store, manager)
        watch.down = {e.index or 0: watch._count(e.index or 0) for e in manager.engines}
        watch._thread.start()
        return watch

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 30)  # a removal in flight is bounded

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - read again next time; the sync reads too
                log.warning("restarting rollout engines not read: %s", exc)

    def poll(self) -> None:
        """Read each engine's restarts begun once: one that began since the last read leaves
        routing (and the router), however quickly it came back."""
        for engine in list(self.manager.engines):  # a scale-out or scale-in may change them
            down = self._count(engine.index or 0)
            if down > self.down.get(engine.index or 0, 0):
                self.down[engine.index or 0] = down
                self.manager.engine_lost(engine.engine_id, "its server is restarting")

    def _count(self, index: int) -> int:
        return restart_count(self.store, "down", "rollout", index)
