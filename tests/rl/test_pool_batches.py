"""``rl/pool_batches.BatchQueue`` with a fake pool (a list of calls "in flight" that the rounds
or ``abandon`` end): a closed queue leaves no descriptor behind, and a caller interrupted while
another thread runs the rounds has its calls ended even when that thread leaves first. The
interleavings are fixed by events and the queue's own wake pipe, not by sleeps."""

from __future__ import annotations

import os
import select
import signal
import threading
from collections import deque

import pytest

from relax_launch.rl.code_config import CodeTestsConfig
from relax_launch.rl.code_pool import CodeSandboxPool
from relax_launch.rl.interfaces import StepAbandoned
from relax_launch.rl.pool_batches import Batch, BatchQueue, Outcome

WAIT_S = 30.0  # a bound on each step of the interleaving: reached only on a bug


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class FakePool:
    """Calls "run" from ``take`` until a round or ``abandon`` ends them."""

    def __init__(self) -> None:
        self.queue = BatchQueue("the fake pool")
        self.running: list[tuple[Batch, int]] = []
        self.abandoned: list[Batch] = []

    def take_all(self) -> None:
        while (job := self.queue.take()) is not None:
            self.running.append(job[:2])

    def end(self, batch: Batch) -> None:
        for call in [c for c in self.running if c[0] is batch]:
            self.running.remove(call)
            self.queue.done(batch, call[1], Outcome(value=1.0))

    def abandon(self, batch: Batch) -> None:
        self.abandoned.append(batch)
        self.end(batch)


def batch_of(calls: int) -> Batch:
    return Batch([Outcome() for _ in range(calls)], 60.0, deque((i, "call") for i in range(calls)))


def test_closed_pools_leave_no_descriptor_behind():
    before = open_fds()
    for _ in range(5):
        BatchQueue("a queue").close()
        CodeSandboxPool(CodeTestsConfig()).close()  # its queue's wake pipe
    assert open_fds() == before


def test_a_queue_closed_under_a_caller_closes_its_pipe_when_the_caller_leaves():
    """The close wakes the caller running the rounds; its round sees the close and raises; the
    pipe is closed once it left, and a late wake writes to no file that took its number."""
    before = open_fds()
    pool, in_round = FakePool(), threading.Event()
    queue = pool.queue

    def run_round():
        pool.take_all()
        in_round.set()
        with queue.lock:  # the close notifies
            assert queue.cond.wait_for(lambda: queue.closed, WAIT_S)
        raise RuntimeError("closed")

    def serve():
        with pytest.raises(RuntimeError, match="closed"):
            queue.serve(batch_of(1), run_round, pool.abandon)

    caller = threading.Thread(target=serve)
    caller.start()
    assert in_round.wait(WAIT_S)
    queue.close()
    caller.join(WAIT_S)
    assert not caller.is_alive() and pool.running == [] and open_fds() == before
    with pytest.raises(RuntimeError, match="closed"):
        queue.serve(batch_of(1), run_round, pool.abandon)
    read_end, write_end = os.pipe()  # likely the numbers the queue's pipe had
    try:
        queue.wake()
        assert select.select([read_end], [], [], 0)[0] == []
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_waiter_interrupted_after_the_rounds_passed_its_calls_has_them_ended():
    """Thread A runs the rounds for its batch and the main thread's (B, only waiting). A's
    round looks at B's call (not abandoned yet), ends A's own call, then B is stopped (a
    signal, as runtime/stop.py's nudge) and leaves; A's batch finished, A leaves without
    another round. B's call must not stay in flight with no one running rounds."""
    pool = FakePool()
    queue = pool.queue
    a_in_round, b_left, a_rounds = threading.Event(), threading.Event(), []

    def a_round():
        queue.drain()  # A's own submission's byte
        pool.take_all()  # A's call
        a_rounds.append(1)
        a_in_round.set()
        assert select.select([queue.wake_fd], [], [], WAIT_S)[0]  # B submitted its batch
        pool.take_all()  # B's call
        assert not any(b.abandoned for b, _ in pool.running)  # the round's look at B's call
        pool.end(batch_a)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        assert b_left.wait(WAIT_S)

    def stop(signum, frame):
        raise StepAbandoned("test")

    batch_a, batch_b = batch_of(1), batch_of(1)
    a_outcomes = []
    thread_a = threading.Thread(
        target=lambda: a_outcomes.append(queue.serve(batch_a, a_round, pool.abandon))
    )
    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        thread_a.start()
        assert a_in_round.wait(WAIT_S)  # B's submission wakes A's select below
        with pytest.raises(StepAbandoned):
            queue.serve(batch_b, lambda: pytest.fail("B ran a round while A did"), pool.abandon)
        b_left.set()
        thread_a.join(WAIT_S)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        queue.close()
    assert not thread_a.is_alive() and len(a_rounds) == 1
    assert a_outcomes[0][0].value == 1.0
    assert pool.running == [] and pool.abandoned == [batch_b], (
        pool.running,
        pool.abandoned,
        batch_b,
    )
