"""Engines that come back (``fault_tolerance``); rollout's membership.

The head rank's side (``EngineRestarts``): when a rollout engine's SGLang server dies, the
head's watchdog restarts it instead of ending the job. It stops what is left of the server and
launches it again on the same port, from the watchdog's own thread, so the server still dies
with the rank (``PR_SET_PDEATHSIG`` follows the thread that started it); a helper thread waits
for its first token. Both are counted in the job's store: ``engine_down/rollout/<index>`` when
a restart begins, ``engine_up/rollout/<index>`` when the server is ready again. A server that
fails to start, or dies more than ``MAX_RESTARTS`` times, ends the job as it would without
fault tolerance. The prefill half of a prefill/decode pair is launched again only after
``PARTNER_FORGETS_S`` (on a later tick of the watchdog): by then its decode halves have given
the dead one up and register anew with the new one (``inference/disaggregation.py``).

Rank 0's side (``RolloutMembership``): meanwhile the controller routes around the engine
(``inference/inprocess.py``); before each weight sync it reads the counts, and when engines left
or came back the trainer forms new broadcast groups with the engines that serve
(``runtime/session.py``). A restarted engine receives the current weights in that sync and is
routed again only once it commits. So does an engine the controller (or a sync) found gone
though its server never restarted (it stopped answering, ``inference/health.py``): before each
sync it is probed once more, and when it answers it takes part in that sync. When no rollout
engine is left, the sync waits (bounded, announced) for one to be restarted.

Teacher and genrm engines are restarted the same way; serving their starting weights, they come
back without a sync (``runtime/static_membership.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from relax_launch.console import operator_log
from relax_launch.deadline import Deadline, wait_until
from relax_launch.inference.disaggregation import PARTNER_FORGETS_S, halves_without_partner
from relax_launch.inference.engine import EngineRequestError, get_json
from relax_launch.inference.health import HealthProbe

MAX_RESTARTS = 3  # per engine and job: a server that keeps dying has a cause restarts won't fix
PROBE_S = HealthProbe().timeout_s  # a lost engine's probe before a sync: SGLang's own bound


def engine_key(event: str, role: str, index: int) -> str:
    """Where an engine's head counts its restarts: ``down`` (begun) and ``up`` (ready again)."""
    return f"engine_{event}/{role}/{index}"


def restart_count(store: Any, event: str, role: str, index: int) -> int:
    """How many restarts of the engine its head has counted as ``event`` (0: none yet)."""
    key = engine_key(event, role, index)
    return int(store.get(key)) if store.check([key]) else 0


class EngineRestarts:
    """Restarts one engine's server (an ``EngineWorker``) for its head rank's watchdog."""

    def __init__(self, store: Any, worker: Any, timeout_s: float) -> None:
        self.store, self.worker, self.timeout_s = store, worker, timeout_s
        self.count = 0
        self.pending = False  # launched again (or about to be), not ready yet
        self.failure: str | None = None  # why the job must end after all
        # a prefill half starts again only once its decode halves forgot the dead one
        prefill = getattr(worker.engine, "disaggregation", None) == "prefill"
        self.hold_s = PARTNER_FORGETS_S if prefill else 0.0
        self.held: tuple[Deadline, str] | None = None  # a launch waiting out hold_s, and why

    def restart(self, died: str) -> str | None:
        """The server died (``died`` says how): start it again (a prefill half after
        ``hold_s``, see ``proceed``). Returns why the job must end instead, or None. Called on
        the watchdog's thread."""
        if self.count >= MAX_RESTARTS:
            return f"{died}, for the {self.count + 1}th time ({MAX_RESTARTS} restarts allowed)"
        self.count += 1
        self.pending = True
        engine = self.worker.engine
        self.store.set(engine_key("down", engine.role, engine.index), str(self.count))
        if self.hold_s:
            self.held = (Deadline(self.hold_s), died)
            return self._stop(died)
        return self._stop(died) or self._launch(died)

    def proceed(self) -> str | None:
        """The watchdog's tick while a restart is pending: a held launch starts once its hold
        is over, on the watchdog's thread (the server dies with the rank). Returns why the job
        must end instead, or None."""
        if self.held is None or not self.held[0].passed:
            return None
        died, self.held = self.held[1], None
        return self._launch(died)

    def _stop(self, died: str) -> str | None:
        try:
            self.worker.server.stop()  # what is left of it: its scheduler may outlive its launcher
        except Exception as exc:  # noqa: BLE001 - not started again: the job ends as without
            self.pending, self.held = False, None
            return f"{died}; restarting it failed: {type(exc).__name__}: {exc}"
        return None

    def _launch(self, died: str) -> str | None:
        try:
            self.worker.launch()
        except Exception as exc:  # noqa: BLE001 - not started again: the job ends as without
            self.pending = False
            return f"{died}; restarting it failed: {type(exc).__name__}: {exc}"
        threading.Thread(
            target=self._wait_ready, args=(died,), name="relax-engine-restart", daemon=True
        ).start()
        return None

    def _wait_ready(self, died: str) -> None:
        engine = self.worker.engine
        try:
            self.worker.wait_ready(self.timeout_s)
            self.store.set(engine_key("up", engine.role, engine.index), str(self.count))
        except Exception as exc:  # noqa: BLE001 - whatever it was, the engine is not coming back
            self.failure = f"{died}; restarting it failed: {type(exc).__name__}: {exc}"
        finally:
            self.pending = False


class RolloutMembership:
    """Rank 0: which rollout engines take the next weight sync, from the heads' counts, the
    engines the controller found dead (``InferenceManager.lost``) and those a scale-out or
    scale-in added or removed (``max_engines``). Engines are named by their plan index."""

    def __init__(
        self, store: Any, manager: Any, alive: Callable[[str], bool] | None = None
    ) -> None:
        self.store, self.manager = store, manager
        # whether a lost engine at this URL answers again (one probe, SGLang's own bound)
        self.alive = alive or (lambda url: engine_alive(url, PROBE_S))
        self.synced: tuple[int, ...] | None = None  # the engines of the current broadcast groups
        self.up: dict[int, int] = {}  # restarts taken back, per engine
        self.restarts = 0
        self.regenerated = 0  # the manager's count of requests sent again, at the last metrics
        self.held: set[str] = set()  # live halves out of routing with their pair (``_hold``)

    def before_sync(self) -> tuple[int, ...] | None:
        """The engines (indices) the next sync goes to when they differ from the last one's,
        else None. A restarting engine leaves routing; a restarted or scaled-out one comes into
        it (it is not routable before the sync commits), and so does a lost engine that never
        restarted once it answers ``/health`` again. With none left, it waits for one
        (``_wait_for_an_engine``)."""
        came_back = self._take_back()
        came_back = self._hold_pairs() or came_back
        members = self._members()
        if not members:
            came_back, members = True, self._wait_for_an_engine()
        changed = came_back or members != self.synced
        self.synced = members
        return members if changed else None

    def _take_back(self) -> bool:
        """Read the counts once; whether an engine came (back) into the next sync."""
        came_back = False
        for engine in self.manager.engines:
            index = engine.index
            down, up = (self._count(event, index) for event in ("down", "up"))
            lost_alone = engine.engine_id in self.manager.lost.keys() - self.held
            if down > up:
                self.held.discard(engine.engine_id)  # out for a reason of its own now
                self.manager.engine_lost(engine.engine_id, "its server is restarting")
            elif up > self.up.get(index, 0):  # even one never seen lost: it left its group
                self.restarts += up - self.up.get(index, 0)
                self.up[index], came_back = up, True
                self.manager.engine_back(engine.engine_id)
            elif lost_alone and self.alive(engine.url):
                came_back = True  # it stopped answering for a while, not for good
                self.manager.engine_back(engine.engine_id)
        for engine_id in list(self.manager.joining):  # scaled out: in this sync's groups
            self.manager.admit(engine_id)
            came_back = True
        return came_back

    def _hold_pairs(self) -> bool:
        """A prefill/decode pair with a half out leaves routing and the sync whole: the live
        half holds requests that wait on its partner's KV transfer until SGLang gives them up,
        which a sync's cache flush refuses. It comes back with its partner (returns whether one
        did)."""
        out = self.manager.lost.keys() - self.held  # out for a reason of their own
        alone = halves_without_partner(self.manager.engines, out)
        for engine_id in alone - self.held - out:
            self.manager.engine_lost(engine_id, "its prefill/decode partner is out of routing")
        back = self.held - alone
        for engine_id in back:
            self.manager.engine_back(engine_id)
        self.held = (self.held | (alone - out)) - back
        return bool(back)

    def _members(self) -> tuple[int, ...]:
        serving = {e.engine_id for e in self.manager.serving()}
        return tuple(e.index for e in self.manager.engines if e.engine_id in serving)

    def _wait_for_an_engine(self) -> tuple[int, ...]:
        """No rollout engine serves: wait for one to be restarted (at most the manager's
        ``restart_wait_s``, announced once), polling the heads' counts."""
        bound = self.manager.restart_wait_s if self.manager.fault_tolerant else 0.0
        found = None
        if bound > 0:
            operator_log().warning(
                "relax-launch: every rollout engine is out of routing; the weight sync waits up "
                f"to {bound:.0f} s for one to be restarted"
            )
            found = wait_until(lambda: self._take_back() and self._members(), bound, 0.5)
        if not found:
            raise RuntimeError(
                f"every rollout engine is down and none came back within {bound:.0f} s; none is "
                "left to sync or serve"
            )
        return found

    def drop(self, dead: list[int], why: str) -> None:
        """Engines (indices) found dead during a sync leave routing until they come back."""
        for engine in self.manager.engines:
            if engine.index in dead:
                self.manager.engine_lost(engine.engine_id, why)
        self.synced = tuple(i for i in (self.synced or ()) if i not in dead)

    def describe(self, members: tuple[int, ...], weight_version: int) -> str:
        """The operator's line when the engines of the next sync changed."""
        left = [e.index for e in self.manager.engines if e.index not in members]
        which = f"rollout engines {list(members)} take" if left else "every rollout engine takes"
        line = f"relax-launch: {which} weight version {weight_version}"
        if left:
            line += f"; engines {left} are out of routing (restarting or scaled in)"
        return f"{line} ({self.restarts} restarted so far)"

    def metrics(self) -> dict[str, float]:
        """Once per step: engines serving, restarts so far, and the generations lost on a dead
        (or scaled-in) engine and generated again elsewhere since the step before."""
        regenerated, self.regenerated = self.regenerated, self.manager.requests.regenerated
        return {
            "rollout/engines_serving": float(len(self.manager.serving())),
            "rollout/engine_restarts": float(self.restarts),
            "rollout/prompts_regenerated": float(self.regenerated - regenerated),
        }

    def _count(self, event: str, index: int) -> int:
        return restart_count(self.store, event, "rollout", index)


def engine_alive(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the engine at ``url`` answers ``/health``."""
    try:
        get_json(url, "/health", timeout_s)
        return True
    except EngineRequestError:
        return False
