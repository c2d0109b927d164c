"""Several callers' batches on one scoring pool at once (``rl/reward_pool.py``'s workers,
``rl/code_pool.py``'s sandboxes): an off-policy step scores on its thread while the main thread
evaluates, and neither waits for the other's whole batch. Each caller submits its calls to the
pool's one queue, served round-robin between the batches; whichever caller finds no one running
the pool's rounds runs them (for every batch), the others wait on their own batch. A round is
bounded by the earliest deadline in flight, so a waiter's every wait is bounded by the longest
call's limit: past it with nothing ended, it raises naming what it waited on."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_launch.deadline import Deadline

STALL_MARGIN_S = 10.0  # past the longest round: a killed call's reaping


@dataclass
class Outcome:
    """One call's result: its value, or why it has none (timed out, or the scorer's error)."""

    value: float | None = None
    timed_out: bool = False
    error: str | None = None


@dataclass(eq=False)
class Batch:
    """One caller's calls: those not yet sent, how many are in flight, and the outcomes."""

    outcomes: list[Outcome]
    timeout_s: float  # each call's limit, from its start
    pending: deque[tuple[int, Any]] = field(default_factory=deque)
    running: int = 0
    abandoned: bool = False
    owner: str = field(default_factory=lambda: threading.current_thread().name)

    @property
    def finished(self) -> bool:
        return not self.pending and self.running == 0


class BatchQueue:
    """The batches of one pool; ``serve`` runs a caller's batch to its end."""

    def __init__(self, name: str) -> None:
        self.name = name
        # entered as the C lock itself: a stop raised from a signal handler in the main thread
        # (``StepAbandoned``) can land in Condition.__enter__'s Python frame after the acquire
        # and leave the lock held, blocking every other caller
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.batches: list[Batch] = []
        self.pump: str | None = None  # the thread running the rounds
        self.ended = 0  # calls ended over the queue's life (a waiter's sign of progress)
        self.closed = False
        # batches abandoned by a caller that did not run the rounds, with their ``abandon``: the
        # rounds end their calls, or, if none is left to run, the last caller to leave
        self.orphans: list[tuple[Batch, Callable[[Batch], None]]] = []
        # a byte here wakes the round's select: a new batch's calls start, an abandoned one's end
        self.wake_fd, self._wake_w = os.pipe()
        self._pipe_open = True  # closed once the queue is closed and no caller is left
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    def take(self) -> tuple[Batch, int, Any] | None:
        """The next call to send, the batches taking turns; None when none waits."""
        with self.lock:
            for batch in list(self.batches):
                self.batches.remove(batch)
                self.batches.append(batch)  # the next take starts from the batch after it
                if batch.pending and not batch.abandoned:
                    index, call = batch.pending.popleft()
                    batch.running += 1
                    return batch, index, call
        return None

    def done(self, batch: Batch, index: int, outcome: Outcome) -> None:
        """A call sent by ``take`` ended."""
        with self.lock:
            batch.outcomes[index] = outcome
            batch.running -= 1
            self.ended += 1
            self.cond.notify_all()

    def wake(self) -> None:
        with self.lock:  # once closed, its number may be another file's
            if self._pipe_open:
                with contextlib.suppress(BlockingIOError):  # full: the round wakes anyway
                    os.write(self._wake_w, b"x")

    def drain(self) -> None:
        """Called by the thread running the rounds: inside ``serve``, the pipe is open."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_fd, 1 << 12)

    def serve(
        self,
        batch: Batch,
        run_round: Callable[[], None],
        abandon: Callable[[Batch], None],
        extra_s: float = 0.0,
    ) -> list[Outcome]:
        """Run ``batch`` to its end: ``run_round`` while no other thread does, else wait on it,
        each wait bounded by the batches' limits and ``extra_s`` (what else a round may wait
        on: a worker's start). Interrupted (a stop abandons the step, the pool closed), the
        batch's calls not sent are dropped and those in flight ended: by ``abandon`` when this
        thread runs the rounds, else by the one that does, at its next round, or, if it leaves
        first, by the last caller to leave (``_settle``)."""
        me = threading.current_thread().name
        try:  # from the batch's entry on: a stop landing anywhere takes it off the queue
            with self.lock:
                if self.closed:
                    raise RuntimeError(f"{self.name} are closed")
                self.batches.append(batch)
            self.wake()
            while not self._turn(batch, me, extra_s):
                run_round()
            return batch.outcomes
        except BaseException:
            with self.lock:
                batch.abandoned = True
                batch.pending.clear()
                pumping = self.pump == me
                if not pumping and batch.running:
                    self.orphans.append((batch, abandon))
            if pumping:
                abandon(batch)
            self.wake()
            raise
        finally:
            with self.lock:
                if batch in self.batches:
                    self.batches.remove(batch)
                if self.pump == me:
                    self.pump = None
                self.cond.notify_all()
            self._settle(me)

    def _turn(self, batch: Batch, me: str, extra_s: float) -> bool:
        """True when ``batch`` ended; False when this thread is to run a round (waiting, while
        another runs them, for its batch to end or the rounds to be its own)."""
        with self.lock:
            while not batch.finished:
                if self.pump in (None, me):
                    self.pump = me
                    return False
                longest = max(b.timeout_s for b in self.batches) + extra_s
                ended, bound = self.ended, longest + STALL_MARGIN_S
                deadline = Deadline(bound)
                self.cond.wait(timeout=bound)
                if self.ended == ended and deadline.passed:
                    raise RuntimeError(
                        f"{self.name}: no call ended for {bound:.0f} s while {self.pump} ran the "
                        f"pool's rounds; this thread's {len(batch.pending)} calls unsent and "
                        f"{batch.running} in flight of its {len(batch.outcomes)} waited on them"
                    )
            return True

    def close(self) -> None:
        """Take no batch any more and wake every caller (each sees the pool closed at its next
        look); once they left (a bounded wait), end the orphans' calls and close the pipe. A
        caller still there past it does so when it leaves."""
        with self.lock:
            self.closed = True
            self.cond.notify_all()
        self.wake()
        with self.lock:
            self.cond.wait_for(lambda: self.pump is None and not self.batches, STALL_MARGIN_S)
        self._settle(threading.current_thread().name)

    def _settle(self, me: str) -> None:
        """With no caller left, no round will end the orphans' calls: end them here (holding
        the rounds meanwhile) and, the queue closed, close the wake pipe."""
        with self.lock:
            if self.pump is not None or self.batches:
                return
            orphans = [(batch, abandon) for batch, abandon in self.orphans if batch.running]
            self.orphans = []
            self.pump = me
        try:
            for batch, abandon in orphans:
                abandon(batch)
        finally:
            with self.lock:
                self.pump = None
                if self.closed and self._pipe_open and not self.batches:
                    self._pipe_open = False
                    os.close(self.wake_fd)
                    os.close(self._wake_w)
                self.cond.notify_all()
