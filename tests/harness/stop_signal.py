"""A stop as runtime/stop.py's nudge makes it: ``StepAbandoned`` raised from a signal handler
in the waiting thread, here after a timer."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from relax_launch.rl.interfaces import StepAbandoned


@contextmanager
def abandoned_after(seconds: float, within_s: float) -> Iterator[None]:
    """The block must end by ``StepAbandoned`` from a SIGALRM ``seconds`` in, and within
    ``within_s`` of its start (at once, not at some wait's limit)."""

    def stop(signum, frame):
        raise StepAbandoned("test")

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        start = time.monotonic()
        with pytest.raises(StepAbandoned):
            yield
        assert time.monotonic() - start < within_s
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
