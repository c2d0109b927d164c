"""Whether processes still run, by psutil (one way to ask, for every check in the job): a PID,
or a whole process group (an engine's server and the processes it started)."""

from __future__ import annotations

import os

import psutil


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, not yet reaped by its parent, has died)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_alive(pgid: int | None) -> bool:
    """Whether any process of group ``pgid`` still runs (zombies aside)."""
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)  # cheap: no process of the group at all
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False
