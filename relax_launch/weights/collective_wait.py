"""Waiting for a collective the same way under gloo and NCCL: poll, never ``wait(timeout)``.

The two backends disagree on what ``work.wait(timeout)`` means. Under gloo it waits up to
``timeout`` and raises if the work is still running; the work goes on and can be waited for
again. Under NCCL (``ProcessGroupNCCL::WorkNCCL``) it blocks until the work completes or until
``timeout`` has passed *since the work was enqueued*, and on expiry marks the work failed,
**aborts the communicator** and raises: every later collective of the group fails. A loop that
waits a second at a time and reads the error as "not finished yet" is correct under gloo and
destroys the group under NCCL the first time a broadcast queues for more than a second.

``wait_for`` polls ``work.is_completed()`` instead (non-blocking on both: it queries the CUDA
event under NCCL, the worker thread's flag under gloo), runs the caller's checks between polls
(has the sender given up, has an engine refused), and only then calls ``work.wait()`` with no
timeout, which raises the work's own error if it failed (and, under NCCL, orders the current
stream after it). The CPU tests run every weight-sync group on ``platform.nccl_semantics``,
gloo with NCCL's ``wait`` and abort, so a wait written the gloo way fails there too.

No torch import here: the SGLang receiver plugin imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from relax_launch.deadline import Deadline

FIRST_POLL_S = 50e-6  # a small tensor's broadcast completes within tens of microseconds
MAX_POLL_S = 1e-3  # later polls back off to this: at most a millisecond added to a wait
CHECK_EVERY_S = 1.0  # how often ``check`` runs while a work is still running


class Work(Protocol):
    def is_completed(self) -> bool: ...
    def wait(self) -> Any: ...


def wait_for(
    work: Work,
    deadline: Deadline | None,
    what: str,
    check: Callable[[], None] | None = None,
) -> float:
    """Wait until ``work`` completes; returns the seconds waited. ``check`` runs about every
    ``CHECK_EVERY_S`` while it has not (it raises to give up the wait); ``deadline`` (``what``
    names the wait in its error) bounds it, None where the group's own timeout does (a receive
    whose sender's group times out fails by itself). A work that failed raises its error."""
    began = time.monotonic()
    poll_s, next_check = FIRST_POLL_S, began + CHECK_EVERY_S
    while not work.is_completed():
        now = time.monotonic()
        if deadline is not None and deadline.passed:
            deadline.left(what)  # the deadline's own error, where it has one
            raise TimeoutError(f"{what}: not done within {deadline.timeout_s:.0f} s")
        if check is not None and now >= next_check:
            check()
            next_check = now + CHECK_EVERY_S
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, MAX_POLL_S)
    work.wait()  # no timeout: raises the work's error, if any; never aborts the group
    return time.monotonic() - began
