"""Which live processes a test started: each test's processes inherit a tag in their
environment (set by the ``no_process_outlives_the_test`` fixture), orphans included."""

from __future__ import annotations

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
