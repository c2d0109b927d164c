"""The operator's console: the logger of the lines the operator reads on rank 0's console (the
plan, progress, checkpoints, the summary, errors). Where they and every rank's other output go
is ``runtime/rank_output.py``."""

from __future__ import annotations

import logging

CONSOLE_LOGGER = "relax_launch.console"


def operator_log() -> logging.Logger:
    """The logger of the lines the operator reads on rank 0's console."""
    return logging.getLogger(CONSOLE_LOGGER)
