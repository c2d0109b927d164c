"""Stopping a job on purpose: a catchable signal or a STOP file ends it after a final checkpoint.

Any rank may be asked: SIGTERM (torchrun passing on its own, ``scancel``, ``kill``), SIGUSR1
(Slurm's warning before the time limit) or SIGINT. The rank records the request; its watchdog
thread passes it to rank 0 through the job's store, since only rank 0 can stop the job in order:
it ends the step in flight (or drops it if its engines are gone), writes the checkpoint of the
last finished step, stops every rank and exits with ``EXIT_STOPPED``. The other ranks wait for
rank 0's shutdown command meanwhile, so the trainer is there to save. A second SIGINT is the
impatient operator's: that rank leaves at once. ``relax-launch stop RUN_DIR`` writes the
``STOP`` file, which rank 0 reads the same way.

Rank 0 writes how the job ended, and why, into ``{run dir}/end.json`` (``write_end_record``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the launcher reads end records without importing torch
    import torch.distributed as dist

RESUME_KEY = "checkpoint.resume="
STOP_FILE = "STOP"
STOP_KEY = "stop"
FAILURE_NOTICE_S = 2.0  # > the watchdog's tick: time for a neighbour's death to be recorded
EXIT_STOPPED = 75  # EX_TEMPFAIL: the job stopped before its last step and can be resumed
EXIT_ABORTED = 3  # a rank its watchdog ended (the cause is in the job's abort record)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
log = logging.getLogger(__name__)


class StopRequest:
    """One rank's record of a request to stop the job (see the module docstring)."""

    def __init__(self, rank: int, run_dir: Path) -> None:
        self.rank, self.stop_file = rank, run_dir / STOP_FILE
        self.local: str | None = None  # a signal this rank received
        self.job: str | None = None  # rank 0: the request it acts on, from any rank
        self.graceful = False  # until the rank has joined the job, a stop signal just exits
        # the job's recorded failure, if any, waiting up to the seconds given (the watchdog's)
        self.failure: Callable[[float], str | None] = lambda wait_s: None
        self._forwarded = False
        self._changed = threading.Event()

    def install(self) -> None:
        """Catch the stop signals in this (the main) thread."""
        self.stop_file.unlink(missing_ok=True)  # a previous run's request is not this run's
        if self.rank == 0:  # nor its end (a requeued Slurm job reads this run's)
            (self.stop_file.parent / END_RECORD).unlink(missing_ok=True)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.graceful or (signum == signal.SIGINT and self.local is not None):
            raise SystemExit(128 + signum)  # nothing to save yet, or Ctrl-C twice: leave now
        if self.local is None:
            self.local = f"{name} to rank {self.rank}"
            log.warning("relax-launch: %s: rank 0 stops the job after a checkpoint", self.local)
        self._changed.set()

    def poll(self, store: dist.Store) -> None:
        """The watchdog's tick: pass this rank's request to rank 0; on rank 0, take one from
        any rank or from the STOP file."""
        if self.local is not None and not self._forwarded:
            store.compare_set(STOP_KEY, "", self.local)
            self._forwarded = True
        if self.rank == 0 and self.job is None:
            if store.check([STOP_KEY]):
                self.job = store.get(STOP_KEY).decode()
            elif self.stop_file.is_file():
                self.job = f"{self.stop_file} was written"
            if self.job is not None:
                self._changed.set()

    def failed(self) -> str | None:
        """Rank 0, acting on a request: a failure recorded meanwhile, which the request only
        followed (torchrun stops the other ranks with SIGTERM when one dies)."""
        return self.failure(FAILURE_NOTICE_S)

    def requested(self, wait_s: float = 0.0) -> str | None:
        """Rank 0: why the job should stop, if it should; waits up to ``wait_s`` for a request
        still on its way (a failed step may be the first sign of one)."""
        deadline = time.monotonic() + wait_s
        while True:
            reason = self.local or self.job
            if reason is not None or time.monotonic() >= deadline:
                return reason
            self._changed.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))


class JobStopped(Exception):  # noqa: N818 - not an error: the job stopped on request
    """Raised out of the program once rank 0 has stopped the job on request."""

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(f"stopped by {reason} after step {step}")
        self.reason, self.step = reason, step


END_RECORD = "end.json"


def resume_command(argv: list[str] | None = None) -> str:
    """The command that continues this run (from rank 0's ``CONFIG [key=value ...]``)."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith(RESUME_KEY)]
    return " ".join(["relax-launch", "run", *map(shlex.quote, args), "--resume"])


def write_end_record(run_dir: Path, state: str, reason: str, **details: Any) -> None:
    """Rank 0: how the job ended ("completed", "stopped" or "failed") and why, for the launcher
    and ``relax-launch status``."""
    record = {"state": state, "reason": reason, **details, "time": time.time()}
    partial = run_dir / (END_RECORD + ".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, run_dir / END_RECORD)


def read_end_record(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / END_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
