"""A stop as runtime/stop.py's nudge makes it: ``StepAbandoned`` raised from a signal handler
in the waiting thread, here after a timer."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from relax_launch.deadline import Deadline
from relax_launch.rl.interfaces import StepAbandoned


@contextmanager
def abandoned_after(seconds: float, in_flight: Callable[[], list[Deadline]]) -> Iterator[None]:
    """The block must end by ``StepAbandoned`` from a SIGALRM ``seconds`` in, landing while its
    calls are in flight (``in_flight``: their deadlines), none of them past its own limit: at
    once, where the block waits. A wait the signal cannot interrupt would run the handler only
    when it returns, at its calls' limit, with their deadlines passed."""
    landed: list[list[bool]] = []

    def stop(signum, frame):
        landed.append([deadline.passed for deadline in in_flight()])
        raise StepAbandoned("test")

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        with pytest.raises(StepAbandoned):
            yield
        assert len(landed) == 1, "the block ended before the stop landed"
        assert landed[0] and not any(landed[0]), f"calls in flight past their limit: {landed}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
