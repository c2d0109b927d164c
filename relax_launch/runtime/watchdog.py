"""JobWatchdog: every rank notices within seconds that the job is ending, and the job says why once.

One daemon thread per rank, every ``interval_s``:

- publishes the rank's heartbeat (a counter under ``alive/{rank}`` in the job's store);
- ends the rank when the job's abort record is set, when its torchrun agent is gone (the parent
  process changed), or when the store has been unreachable for ``liveness_timeout_s`` (rank 0's
  node, which hosts it, is gone);
- on an engine head, checks the SGLang servers it started: one that exits aborts the job;
- checks that the other ranks of its node still run (their PIDs, published at start): one that
  died aborts the job at once, whoever noticed first;
- on rank 0, checks every rank's heartbeat: one silent for ``liveness_timeout_s`` (its process
  or its whole node died) aborts the job.

The abort record names what died (node, rank, roles, engine, exit code or signal) and the first
writer wins, so every rank and the operator read the cause rather than whatever each noticed
later. A rank that ends stops its engine servers by PID first, then leaves with ``os._exit``: its
main thread may be blocked in a collective whose peer is gone and would never return.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from relax_launch.deadline import Deadline
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label
from relax_launch.processes import running
from relax_launch.run_dir import EXIT_ABORTED, EXIT_STOPPED
from relax_launch.runtime.engine_restart import EngineRestarts
from relax_launch.runtime.stop import StopRequest

ABORT_KEY = "abort"
SHUTDOWN_KEY = "shutdown"
log = logging.getLogger(__name__)


def describe_rank(plan: PlacementPlan, rank: int) -> str:
    """``rank 2 (rollout[e0 head], node 1)``: how every message names a rank."""
    return f"rank {rank} ({roles_label(plan, plan.ranks[rank])}, node {plan.ranks[rank].node})"


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class JobWatchdog:
    """See the module docstring. ``on_end(reason, stopped)`` runs once, on the watchdog's
    thread, before the rank leaves (rank 0 prints the reason for the operator and writes the
    run's end record)."""

    def __init__(
        self,
        store: dist.Store,
        plan: PlacementPlan,
        rank: int,
        stop: StopRequest,
        *,
        liveness_timeout_s: float,
        interval_s: float = 1.0,
    ) -> None:
        self.store, self.plan, self.rank, self.stop = store, plan, rank, stop
        self.liveness_timeout_s, self.interval_s = liveness_timeout_s, interval_s
        self.parent = os.getppid()
        # (what, its server's current Popen, who restarts it or None) for each engine headed here
        self.engines: list[tuple[str, Callable[[], Any], EngineRestarts | None]] = []
        self.closers: list[Callable[[], None]] = []  # stop this rank's servers before leaving
        # (reason, stopped: a stop before the first step, not a failure)
        self.on_end: Callable[[str, bool], None] = lambda reason, stopped: None
        self._stopped_early: str | None = None  # rank 0: the abort record of such a stop
        self.watch_ranks = False  # rank 0, once every rank has joined
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat, when it changed)
        self.siblings: dict[int, int] = {}  # the other ranks of this node -> their PIDs
        self._store_lost_since: float | None = None
        self._quiet = threading.Event()  # the rank is shutting down normally
        self._ended = threading.Lock()  # held by whoever reports the job's end on this rank
        self._thread = threading.Thread(target=self._run, name="relax-watchdog", daemon=True)

    def start(self) -> None:
        """Publish the first heartbeat and this rank's PID now (so others may watch them), then
        keep watching."""
        self.store.set(f"pid/{self.rank}", str(os.getpid()))
        self.store.add(self._alive_key(self.rank), 1)
        self._thread.start()

    def joined(self) -> None:
        """Every rank has started its watchdog: watch this node's other ranks, and on rank 0
        every rank's heartbeat."""
        node = self.plan.ranks[self.rank].node
        others = [r.rank for r in self.plan.ranks if r.node == node and r.rank != self.rank]
        if others:
            pids = self.store.multi_get([f"pid/{r}" for r in others])
            self.siblings = {r: int(pid) for r, pid in zip(others, pids, strict=True)}
        self.watch_ranks = self.rank == 0

    def watch_engine(
        self, what: str, process: Callable[[], Any], restarts: EngineRestarts | None = None
    ) -> None:
        """If the server (``process()``, a started Popen) exits while the job runs, abort the
        job, or have ``restarts`` start it again."""
        self.engines.append((what, process, restarts))

    def quiet(self) -> None:
        """The rank is stopping its own servers: their exits are no longer failures."""
        self._quiet.set()

    def abort(self, reason: str) -> str:
        """Record ``reason`` as why the job ends, unless another rank was first; returns the
        recorded reason. Never raises: the store may be gone already."""
        try:
            current = self.store.compare_set(ABORT_KEY, "", reason)
            return current.decode() if isinstance(current, bytes) else str(current)
        except Exception:  # noqa: BLE001 - the store's host is gone: our reason is all we have
            return reason

    def claim_end(self) -> bool:
        """True the first time only: the one caller that reports this rank's end."""
        return self._ended.acquire(blocking=False)

    def store_answers(self) -> bool:
        try:
            self.store.check([ABORT_KEY])
            return True
        except Exception:  # noqa: BLE001 - any failure means the same here
            return False

    def recorded_abort(self, wait_s: float = 0.0) -> str | None:
        """The abort record, waiting up to ``wait_s`` for another rank to write it."""
        deadline = Deadline(wait_s)
        while True:
            try:
                if self.store.check([ABORT_KEY]):
                    return self.store.get(ABORT_KEY).decode()
            except Exception:  # noqa: BLE001 - no store, no record
                return None
            if deadline.passed:
                return None
            time.sleep(0.1)

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._quiet.wait(self.interval_s):
            reason = self._check()
            if reason is not None and not self._quiet.is_set():
                self._end(reason)
                return

    def _check(self) -> str | None:
        """Why this rank must end now, or None. A death is looked for before a stop request:
        torchrun stops every rank with SIGTERM when one dies, and that stop only follows it."""
        if os.getppid() != self.parent:  # before the store: the agent may have hosted it
            return self.abort(f"{describe_rank(self.plan, self.rank)}: its torchrun agent died")
        silent = None
        try:
            self.store.add(self._alive_key(self.rank), 1)
            if self.store.check([ABORT_KEY]):
                return self.store.get(ABORT_KEY).decode()
            if self.store.check([SHUTDOWN_KEY]):  # ranks and servers now leave on purpose
                self.quiet()
                return None
            silent = self._silent_ranks() if self.watch_ranks else None
            self._store_lost_since = None
        except Exception as exc:  # noqa: BLE001 - a store that does not answer is the news
            if lost := self._store_lost(exc):
                return lost
        if died := self._dead_neighbour() or silent:
            return self.abort(died)
        try:
            self.stop.poll(self.store)
        except Exception:  # noqa: BLE001 - the store's silence is judged above, next tick
            return None
        return self._stop_before_steps()

    def _stop_before_steps(self) -> str | None:
        """Rank 0, asked to stop before its first step: nothing to save, so every rank ends now
        as for a failure (the end record says "stopped"), not after start-up has finished."""
        asked = self.stop.requested() if self.rank == 0 and not self.stop.stepping else None
        if asked is None:
            return None
        self._stopped_early = f"stopped by {asked} before the first step"
        return self.abort(self._stopped_early)

    def _dead_neighbour(self) -> str | None:
        """Another rank of this node, or a server this rank started, that is gone."""
        for r, pid in self.siblings.items():
            if not running(pid):
                return f"{describe_rank(self.plan, r)} died (process {pid})"
        for what, process, restarts in self.engines:
            if restarts is not None and restarts.failure:
                return restarts.failure
            if restarts is not None and restarts.pending:  # it is starting again
                if refused := restarts.proceed():  # a held launch, once its hold is over
                    return refused
                continue
            server = process()  # None: not meant to run (reserved, or scaled in)
            code = server.poll() if server is not None else None
            stopping = self._quiet.is_set() or self.stop.local or self.stop.job
            if code is None or stopping:  # a stop signal may reach the servers too
                continue
            where = describe_rank(self.plan, self.rank)
            died = f"{what} on {where}: its SGLang server {describe_exit(code)}"
            if restarts is None:
                return died
            log.warning("relax-launch: %s; restarting it", died)
            if refused := restarts.restart(died):
                return refused
        return None

    def announce_shutdown(self) -> None:
        """Rank 0, before stopping the ranks: from now on a rank or server that leaves is no
        failure (each watchdog reads this before it looks at its neighbours)."""
        self.quiet()
        self.store.set(SHUTDOWN_KEY, "1")

    def others_alive(self) -> bool:
        """Rank 0, after its program failed: wait until every other rank's heartbeat moves (True:
        an orderly shutdown can reach them), or until this watchdog has recorded why the job
        ends (False: a rank or node died, the ranks end by themselves). Bounded by
        ``liveness_timeout_s``: a rank silent that long is reported as dead meanwhile."""
        since = time.monotonic()
        others = [r.rank for r in self.plan.ranks if r.rank != self.rank]
        deadline = Deadline(self.liveness_timeout_s + 3 * self.interval_s)
        while not deadline.passed and self._thread.is_alive():
            if self.recorded_abort() is not None:
                return False
            if all(self._seen.get(r, (0, 0.0))[1] > since for r in others):
                return True
            time.sleep(self.interval_s / 4)
        return self.recorded_abort() is None

    def end_for_recorded_cause(self) -> None:
        """End this rank now for the job's recorded cause, as the watchdog's thread does when
        it reads it (see ``_end``); never returns."""
        self._end(self.recorded_abort() or f"{describe_rank(self.plan, self.rank)} failed")

    def _silent_ranks(self) -> str | None:
        now = time.monotonic()
        ranks = [r.rank for r in self.plan.ranks if r.rank != self.rank]
        values = self.store.multi_get([self._alive_key(r) for r in ranks]) if ranks else []
        silent = []
        for r, value in zip(ranks, values, strict=True):
            beat = int(value)
            seen = self._seen.get(r)
            if seen is None or seen[0] != beat:
                self._seen[r] = (beat, now)
            elif now - seen[1] > self.liveness_timeout_s:
                silent.append(r)
        if not silent:
            return None
        names = ", ".join(describe_rank(self.plan, r) for r in silent)
        return (
            f"{names} stopped answering for {self.liveness_timeout_s:.0f} s: "
            "the process or its node died"
        )

    def _store_lost(self, exc: Exception) -> str | None:
        now = time.monotonic()
        self._store_lost_since = self._store_lost_since or now
        if now - self._store_lost_since < self.liveness_timeout_s:
            return None
        return store_lost(self.plan, self.rank, exc, f"for {self.liveness_timeout_s:.0f} s")

    def _end(self, reason: str) -> None:
        """Stop this rank's servers, report, and leave the process (see the module docstring)."""
        log.error("relax-launch: the job is ending: %s", reason)
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - stop the rest whatever one did
                log.exception("relax-launch: stopping a server failed")
        stopped = reason == self._stopped_early
        try:
            if self.claim_end():
                self.on_end(reason, stopped)
        finally:
            logging.shutdown()
            os._exit(EXIT_STOPPED if stopped else EXIT_ABORTED)

    def _alive_key(self, rank: int) -> str:
        return f"alive/{rank}"

    def close(self) -> None:
        self.quiet()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def store_lost(plan: PlacementPlan, rank: int, exc: BaseException, how_long: str = "") -> str:
    """Why a rank ends when the job's store, hosted with rank 0, stops answering."""
    return (
        f"{describe_rank(plan, rank)}: the job's store (on node 0, with rank 0) has not answered"
        f"{' ' + how_long if how_long else ''} ({type(exc).__name__}: {exc}): "
        "node 0 or its torchrun agent died"
    )
