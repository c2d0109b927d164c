"""The files of a run directory that the ranks write and the operator's commands read, and the
exit codes that go with them: a request to stop (``STOP``), how the job ended (``end.json``), each
rank's log. Standard library only: ``relax-launch status`` reads them on a login node."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

STOP_FILE = "STOP"  # its text says who asked
END_RECORD = "end.json"
JOB_RECORD = "job.json"  # the job's config as it ran (its checkpoint and export places)
RESUME_KEY = "checkpoint.resume="
JOB_STARTED_ENV = "RELAX_JOB_STARTED"  # a STOP file older than this is a previous run's
LAUNCHER_ENV = "RELAX_LAUNCHER"  # set by `relax-launch run`: it prints how the job ended
EXIT_STOPPED = 75  # EX_TEMPFAIL: the job stopped before its last step and can be resumed
EXIT_ABORTED = 3  # a rank its watchdog ended (the cause is in the job's abort record)


def rank_log_path(log_dir: Path, rank: int) -> Path:
    """The file a rank's stdout, stderr and logging go to."""
    return log_dir / f"rank{rank}.log"


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
    return read_json(run_dir / END_RECORD)


def read_json(path: Path) -> Any:
    """A JSON file of the run directory, or None while it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
