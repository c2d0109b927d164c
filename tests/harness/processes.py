"""Which live processes a test started: each test's processes inherit a tag in their
environment (set by the ``no_process_outlives_the_test`` fixture), orphans included."""

from __future__ import annotations

import time

import psutil

TEST_TAG = "RELAX_TEST_PROCESS_TAG"  # inherited by every process a test starts


def processes_tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` (orphans included: they keep it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get(TEST_TAG) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def seconds_until_gone(tag: str, since: float, limit_s: float = 90) -> float:
    """Seconds from ``since`` (``time.monotonic``) until no process tagged ``tag`` is left;
    fails naming what is left after ``limit_s``."""
    while processes_tagged(tag) and time.monotonic() - since < limit_s:
        time.sleep(0.1)
    left = [" ".join(p.cmdline())[:80] for p in processes_tagged(tag)]
    assert not left, f"left after {limit_s} s: {left}"
    return time.monotonic() - since
