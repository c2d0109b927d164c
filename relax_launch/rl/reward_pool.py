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
from dataclasses import dataclass
from typing import Any

from relax_launch.deadline import Deadline
from relax_launch.rl.reward_frames import HEADER, write_frame

START_TIMEOUT_S = 120.0  # a worker's imports (reasoning-gym, sympy) take seconds, not minutes
TURN_TIMEOUT_S = 600.0  # the wait for another thread's scoring (an off-policy step's) to end


@dataclass
class Outcome:
    """One call's result: its value, or why it has none (timed out, or the scorer's error)."""

    value: float | None = None
    timed_out: bool = False
    error: str | None = None


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
        self.call: tuple[int, Deadline] | None = None  # (index, its deadline) while scoring

    def send(self, index: int, call: tuple[str, tuple], timeout_s: float) -> None:
        write_frame(self.process.stdin, call)
        self.call = (index, Deadline(timeout_s))

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
    """``size`` workers, started at once and replaced when killed."""

    def __init__(self, size: int) -> None:
        self.workers = [Worker() for _ in range(size)]
        self.killed = 0  # workers killed over a limit or lost, over the pool's life
        # one caller at a time: an off-policy step scores on its thread while the main thread
        # may evaluate
        self.turn = threading.Lock()
        self.closed = False
        atexit.register(self.close)

    def run(self, calls: list[tuple[str, tuple]], timeout_s: float) -> list[Outcome]:
        """Each call's outcome, in order; every call ends within ``timeout_s`` of being sent.
        Interrupted (a stop abandons the step), the workers still scoring are replaced: their
        late replies must not answer the next step's calls."""
        outcomes = [Outcome() for _ in calls]
        if not self.turn.acquire(timeout=TURN_TIMEOUT_S):
            raise RuntimeError(f"the scoring workers were busy for {TURN_TIMEOUT_S:.0f} s")
        try:
            return self._run(calls, timeout_s, outcomes)
        except BaseException as exc:
            if self.closed and isinstance(exc, Exception):  # its pipes closed under it
                raise RuntimeError("the scoring pool is closed") from exc
            for number, worker in enumerate(self.workers):
                if worker.call is not None:
                    self._replace(number, outcomes, None)
            raise
        finally:
            self.turn.release()

    def _run(
        self, calls: list[tuple[str, tuple]], timeout_s: float, outcomes: list[Outcome]
    ) -> list[Outcome]:
        pending = deque(enumerate(calls))
        while pending or any(w.call for w in self.workers):
            if self.closed:  # the job is ending (a background step may still be scoring)
                raise RuntimeError("the scoring pool is closed")
            for worker in self.workers:
                if worker.ready and worker.call is None and pending:
                    index, call = pending.popleft()
                    worker.send(index, call, timeout_s)
            self._wait()
            for number, worker in enumerate(self.workers):
                if not self._read(worker, outcomes):
                    if self.closed:  # close() killed it
                        raise RuntimeError("the scoring pool is closed")
                    self._replace(number, outcomes, "the scoring worker exited")
                    if not worker.ready:  # it cannot start: no use starting more
                        raise RuntimeError(
                            f"a scoring worker exited on start (code {worker.process.returncode}"
                            "; its error is in rank 0's log)"
                        )
                elif worker.call is not None and worker.call[1].passed:
                    outcomes[worker.call[0]].timed_out = True
                    self._replace(number, outcomes, None)
                elif not worker.ready and worker.started.passed:
                    raise RuntimeError(
                        f"a scoring worker did not start within {START_TIMEOUT_S:.0f} s"
                    )
        return outcomes

    def _wait(self) -> None:
        """Until a worker writes or the earliest deadline (a call's, a start's) passes."""
        ends = [w.call[1] if w.call else w.started for w in self.workers if w.call or not w.ready]
        timeout = min((d.left() for d in ends), default=0.0)
        select.select([w.fd for w in self.workers], [], [], timeout)

    def _read(self, worker: Worker, outcomes: list[Outcome]) -> bool:
        """Take the worker's finished frames; False when it died."""
        frames, closed = worker.frames()
        for status, value in frames:
            if status == "ready":
                worker.ready = True
                continue
            index = worker.call[0]
            outcomes[index].value = value if status == "ok" else None
            outcomes[index].error = value if status == "error" else None
            worker.call = None
        return not closed

    def _replace(self, number: int, outcomes: list[Outcome], error: str | None) -> None:
        worker = self.workers[number]
        if worker.call is not None and error is not None:
            outcomes[worker.call[0]].error = error
        worker.kill()
        self.killed += 1
        if not self.closed:
            self.workers[number] = Worker()

    def close(self) -> None:
        """Kill every worker (idempotent); a caller still scoring gets a RuntimeError."""
        self.closed = True
        for worker in self.workers:
            if not worker.process.stdin.closed:
                worker.kill()
        self.workers = []
