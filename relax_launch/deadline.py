"""The end of a bounded wait. Every wait in the job has one (no wait is silent or endless):
``Deadline`` says how long is left and whether it passed, ``wait_until`` polls a condition
until it holds or the time is up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Deadline:
    """``timeout_s`` from now. Given ``expired`` (what went wrong -> the error to raise),
    ``left(before)`` raises that error once the deadline passed, naming what the caller was
    about to wait for."""

    def __init__(self, timeout_s: float, expired: Callable[[str], Exception] | None = None):
        self.timeout_s, self.expired = timeout_s, expired
        self.end = time.monotonic() + timeout_s

    def left(self, before: str | None = None) -> float:
        """Seconds left, never below 0; with ``before`` and an ``expired`` error, raises it
        instead of returning 0."""
        left = self.end - time.monotonic()
        if left <= 0 and before is not None and self.expired is not None:
            raise self.expired(before)
        return max(left, 0.0)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.1,
    max_interval_s: float | None = None,
) -> T | None:
    """Call ``condition`` every ``interval_s`` (doubling up to ``max_interval_s`` when given)
    until it returns something truthy, which is returned; None once ``timeout_s`` passed."""
    deadline = Deadline(timeout_s)
    while True:
        if result := condition():
            return result
        if deadline.passed:
            return None
        time.sleep(min(interval_s, deadline.left()))
        if max_interval_s is not None:
            interval_s = min(2 * interval_s, max_interval_s)
