"""Scoring workers for the rewards that parse or run what a model wrote (``math_verify``,
``reasoning_gym``): each sample is scored in a worker process (``rl/reward_worker.py``) under
a time limit. A sample over the limit gets no value and is counted as timed out; its worker is
killed by PID and a fresh one started in its place, so one adversarial answer costs the step
at most the limit, never a hang. Rank 0 waits on the workers' pipes with ``select``, bounded
by the earliest deadline in flight; ``close`` (and the workers' PDEATHSIG) leaves no worker
behind."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import Any

from relax_launch.deadline import Deadline
from relax_launch.rl.pool_batches import Batch, BatchQueue, Outcome
from relax_launch.rl.reward_frames import HEADER, write_frame

START_TIMEOUT_S = 120.0  # a worker's imports (reasoning-gym, sympy) take seconds, not minutes


class Worker:
    """One worker process and the bytes read from it so far."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", "relax_launch.rl.reward_worker", str(os.getpid())]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.fd = self.process.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = bytearray()
        self.ready = False
        self.started = Deadline(START_TIMEOUT_S)
        # ((its batch, its index there), its deadline) while scoring
        self.call: tuple[tuple[Batch, int], Deadline] | None = None

    def send(self, job: tuple[Batch, int], call: tuple[str, tuple], timeout_s: float) -> None:
        """Send call ``job`` (its batch, its index there), to end within ``timeout_s``."""
        write_frame(self.process.stdin, call)
        self.call = (job, Deadline(timeout_s))

    def frames(self) -> tuple[list[Any], bool]:
        """The frames that arrived complete, and whether the worker's stdout closed."""
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            chunk = None
        if chunk is not None:
            self.buffer += chunk
        out = []
        while len(self.buffer) >= HEADER.size:
            size = HEADER.unpack(self.buffer[: HEADER.size])[0]
            if len(self.buffer) < HEADER.size + size:
                break
            out.append(pickle.loads(self.buffer[HEADER.size : HEADER.size + size]))
            del self.buffer[: HEADER.size + size]
        return out, chunk == b""

    def kill(self) -> None:
        """SIGKILL by PID and reap it (a killed process exits at once)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # reaped meanwhile by another thread
                os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


class ScoringPool:
    """``size`` workers, started at once and replaced when killed; several callers' batches
    share them (``rl/pool_batches.py``: an off-policy step scores on its thread while the main
    thread may evaluate)."""

    def __init__(self, size: int) -> None:
        self.workers = [Worker() for _ in range(size)]
        self.killed = 0  # workers killed over a limit or lost, over the pool's life
        self.queue = BatchQueue("the scoring workers")
        self.closed = False
        self._spawn_lock = threading.Lock()  # a replacement never starts after close's kills
        atexit.register(self.close)

    def run(self, calls: list[tuple[str, tuple]], timeout_s: float) -> list[Outcome]:
        """Each call's outcome, in order; every call ends within ``timeout_s`` of being sent.
        Interrupted (a stop abandons the step), its workers still scoring are replaced: their
        late replies must not answer the next step's calls."""
        batch = Batch([Outcome() for _ in calls], timeout_s, deque(enumerate(calls)))
        try:
            return self.queue.serve(batch, self._round, self._abandon, START_TIMEOUT_S)
        except Exception as exc:
            if self.closed:  # its pipes closed under it
                raise RuntimeError("the scoring pool is closed") from exc
            raise

    def _round(self) -> None:
        """Send what the free workers take, wait for a reply or a deadline, take the replies."""
        if self.closed:  # the job is ending (a background step may still be scoring)
            raise RuntimeError("the scoring pool is closed")
        for worker in self.workers:
            if worker.ready and worker.call is None and (job := self.queue.take()):
                batch, index, call = job
                worker.send((batch, index), call, batch.timeout_s)
        self._wait()
        for number, worker in enumerate(self.workers):
            if not self._read(worker):
                if self.closed:  # close() killed it
                    raise RuntimeError("the scoring pool is closed")
                self._replace(number, "the scoring worker exited")
                if not worker.ready:  # it cannot start: no use starting more
                    raise RuntimeError(
                        f"a scoring worker exited on start (code {worker.process.returncode}"
                        "; its error is in rank 0's log)"
                    )
            elif worker.call is not None and worker.call[1].passed:
                self._replace(number, None, timed_out=True)
            elif worker.call is not None and worker.call[0][0].abandoned:
                self._replace(number, None)  # its caller is gone: its reply must not come late
            elif not worker.ready and worker.started.passed:
                raise RuntimeError(f"a scoring worker did not start within {START_TIMEOUT_S:.0f} s")

    def _abandon(self, batch: Batch) -> None:
        for number, worker in enumerate(self.workers):
            if worker.call is not None and worker.call[0][0] is batch:
                self._replace(number, None)

    def _wait(self) -> None:
        """Until a worker writes, a caller wakes the round, or the earliest deadline (a
        call's, a start's) passes."""
        ends = [w.call[1] if w.call else w.started for w in self.workers if w.call or not w.ready]
        timeout = min((d.left() for d in ends), default=0.0)
        select.select([self.queue.wake_fd, *(w.fd for w in self.workers)], [], [], timeout)
        self.queue.drain()

    def _read(self, worker: Worker) -> bool:
        """Take the worker's finished frames; False when it died."""
        frames, closed = worker.frames()
        for status, value in frames:
            if status == "ready":
                worker.ready = True
                continue
            (batch, index), _ = worker.call
            worker.call = None
            outcome = Outcome(value=value if status == "ok" else None)
            outcome.error = value if status == "error" else None
            self.queue.done(batch, index, outcome)
        return not closed

    def _replace(self, number: int, error: str | None, timed_out: bool = False) -> None:
        """Kill the worker (its call, if any, ends with ``error`` or timed out) and start
        another in its place."""
        worker = self.workers[number]
        if worker.call is not None:
            (batch, index), _ = worker.call
            worker.call = None
            self.queue.done(batch, index, Outcome(timed_out=timed_out, error=error))
        worker.kill()
        self.killed += 1
        with self._spawn_lock:
            if not self.closed:
                self.workers[number] = Worker()

    def close(self) -> None:
        """Kill every worker (idempotent); a caller still scoring gets a RuntimeError."""
        with self._spawn_lock:
            self.closed = True
            workers, self.workers = self.workers, []
        for worker in workers:
            if not worker.process.stdin.closed:
                worker.kill()
        self.queue.close()
