"""Stopping a job on purpose: a catchable signal or a STOP file ends it after a final checkpoint.

Any rank may be asked: SIGTERM (``scancel``, ``kill``, torchrun passing on its own), SIGUSR1
(Slurm's warning before the time limit) or SIGINT. The rank records the request; its watchdog
thread passes it to rank 0 through the job's store, since only rank 0 can stop the job in order.
``relax-launch run`` turns its own first Ctrl-C or SIGTERM into the ``STOP`` file (torchrun is
not signalled: it would give the ranks 30 s), as do ``relax-launch stop RUN_DIR`` and the
sbatch script on Slurm's warning; the file's text says who asked.

Rank 0 does not wait for the step in flight. The waits of a step that can be dropped without
harm — generation, teacher and judge scoring, reward functions, a background rollout — are
*abandonable*: the stop interrupts them at once (``StepAbandoned`` in rank 0's main thread, the
engine requests cancelled); a train step or a weight sync in flight finishes (cutting either
would leave the optimizer or the engines half-updated). Rank 0 then writes the checkpoint of
the last finished step, stops every rank and exits with ``EXIT_STOPPED``. Before the first step
there is nothing to save: the job ends at once. A second SIGINT is the impatient operator's:
that rank leaves at once.

Rank 0 writes how the job ended, and why, into the run directory's end record
(``run_dir.write_end_record``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_launch.deadline import Deadline
from relax_launch.rl.interfaces import StepAbandoned
from relax_launch.run_dir import END_RECORD, JOB_STARTED_ENV, STOP_FILE

if TYPE_CHECKING:  # the launcher reads end records without importing torch
    import torch.distributed as dist

STOP_KEY = "stop"
FAILURE_NOTICE_S = 2.0  # > the watchdog's tick: time for a neighbour's death to be recorded
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The watchdog thread's nudge to rank 0's main thread: a request came through the store.
NUDGE = signal.SIGUSR2
log = logging.getLogger(__name__)


def signal_name(signum: int) -> str:
    """``SIGINT (Ctrl-C)``, ``SIGTERM``: how a stop names the signal that asked for it."""
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


class StopRequest:
    """One rank's record of a request to stop the job (see the module docstring)."""

    def __init__(self, rank: int, run_dir: Path) -> None:
        self.rank, self.stop_file = rank, run_dir / STOP_FILE
        self.local: str | None = None  # a signal this rank received
        self.job: str | None = None  # rank 0: the request it acts on, from any rank
        self.graceful = False  # until the rank has joined the job, a stop signal just exits
        self.stepping = False  # rank 0: steps have begun, so a stop has something to save
        # the job's recorded failure, if any, waiting up to the seconds given (the watchdog's)
        self.failure: Callable[[float], str | None] = lambda wait_s: None
        # rank 0: run once, on the watchdog's thread, when a request is first known (e.g. cancel
        # the engine requests in flight)
        self.listeners: list[Callable[[str], None]] = []
        self._abandonable = 0  # rank 0's main thread: depth of abandonable waits it is in
        self._forwarded = self._announced = False
        self._changed = threading.Event()

    def install(self) -> None:
        """Catch the stop signals in this (the main) thread."""
        if self.rank == 0:  # a previous run's request is not this run's, nor its end record
            started = float(os.environ.get(JOB_STARTED_ENV, time.time()))
            with contextlib.suppress(FileNotFoundError):
                if self.stop_file.stat().st_mtime < started:  # one from our launcher stays
                    self.stop_file.unlink()
            (self.stop_file.parent / END_RECORD).unlink(missing_ok=True)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        if self.rank == 0:
            signal.signal(NUDGE, self._on_nudge)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.graceful or (signum == signal.SIGINT and self.local is not None):
            raise SystemExit(128 + signum)  # nothing to save yet, or Ctrl-C twice: leave now
        if self.local is None:
            self.local = f"{signal_name(signum)} to rank {self.rank}"
            log.warning("relax-launch: %s: rank 0 stops the job after a checkpoint", self.local)
        self._changed.set()
        self._on_nudge(signum, frame)

    def _on_nudge(self, signum: int, frame: Any) -> None:
        reason = self.local or self.job
        if reason is not None and self._abandonable and self.rank == 0:
            raise StepAbandoned(reason)

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """Rank 0's main thread: a wait the stop may interrupt, at once if the request is known
        already. Inside, a stop raises ``StepAbandoned``, and so does any error once a stop is
        known (the stop cancelled the requests the wait was for)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # a background thread is not interrupted: its waiter is
            return
        self._abandonable += 1
        try:
            self.check()
            yield
        except Exception as exc:
            if (reason := self.local or self.job) is None:
                raise
            raise StepAbandoned(reason) from exc
        finally:
            self._abandonable -= 1

    def poll(self, store: dist.Store) -> None:
        """The watchdog's tick: pass this rank's request to rank 0; on rank 0, take one from
        any rank or from the STOP file, and act on it."""
        if self.local is not None and not self._forwarded:
            store.compare_set(STOP_KEY, "", self.local)
            self._forwarded = True
        if self.rank == 0 and self.job is None:
            if store.check([STOP_KEY]):
                self.job = store.get(STOP_KEY).decode()
            elif self.stop_file.is_file():
                asked = self.stop_file.read_text(errors="replace").strip()
                self.job = asked or f"{self.stop_file} was written"
            if self.job is not None:
                self._changed.set()
        if self.rank != 0 or (reason := self.local or self.job) is None:
            return
        if not self._announced:
            self._announced = True
            for listener in self.listeners:
                try:
                    listener(reason)
                except Exception:  # noqa: BLE001 - the stop goes on whatever a listener did
                    log.exception("relax-launch: acting on the stop request failed")
        if self._abandonable and self.rank == 0:  # only there: a signal could break the
            # system call of a collective, which Python does not retry (gloo's, the store's)
            signal.pthread_kill(threading.main_thread().ident, NUDGE)

    def check(self) -> None:
        """Rank 0, between phases: ``StepAbandoned`` if a stop is known."""
        if (reason := self.local or self.job) is not None:
            raise StepAbandoned(reason)

    def failed(self) -> str | None:
        """Rank 0, acting on a request: a failure recorded meanwhile, which the request only
        followed (torchrun stops the other ranks with SIGTERM when one dies)."""
        return self.failure(FAILURE_NOTICE_S)

    def requested(self, wait_s: float = 0.0) -> str | None:
        """Rank 0: why the job should stop, if it should; waits up to ``wait_s`` for a request
        still on its way (a failed step may be the first sign of one)."""
        deadline = Deadline(wait_s)
        while True:
            reason = self.local or self.job
            if reason is not None or deadline.passed:
                return reason
            self._changed.wait(min(0.1, deadline.left()))
