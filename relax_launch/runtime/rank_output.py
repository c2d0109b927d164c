"""Where a rank's output goes: the operator's console, or the rank's own log file.

Every rank sends its stdout and stderr (library warnings, Megatron and transformers prints,
tracebacks) to ``{run dir}/rank{R}.log`` at the file-descriptor level, so C extensions and child
processes follow. Rank 0 keeps the original stdout for the operator: lines logged to the
``relax_launch.console`` logger (plan, progress, checkpoints, summary) appear there, and in the
rank's log file too.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from rich.console import Console

from relax_launch.console import operator_log
from relax_launch.run_dir import rank_log_path


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console) -> None:
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(record.getMessage(), markup=False, highlight=False, soft_wrap=True)


def route_rank_output(log_dir: Path, rank: int, level: str, label: str) -> Console | None:
    """Send this process's output to its rank log and apply ``logging.level``; on rank 0, return
    the operator's console (the original stdout), which the console logger also writes to."""
    log_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console_fd = os.dup(sys.stdout.fileno()) if rank == 0 else None
    log_fd = os.open(rank_log_path(log_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, sys.stdout.fileno())
    os.dup2(log_fd, sys.stderr.fileno())
    os.close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s %(levelname)s [rank {rank} {label}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.captureWarnings(True)  # library UserWarnings: into the log, at WARNING
    # one INFO line per HTTP request (httpx, under the OpenAI client a reward function may use)
    # would bury the rank's own lines
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    operator = operator_log()
    operator.setLevel(logging.INFO)  # operator lines show whatever the libraries' level
    if console_fd is None:
        return None
    console = Console(file=os.fdopen(console_fd, "w", buffering=1), highlight=False)
    operator.handlers = [_ConsoleHandler(console)]
    return console
