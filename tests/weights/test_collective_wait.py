"""The CPU's weight-sync backend behaves as NCCL does where gloo differs (``wait(timeout)``
counts from the enqueue, aborts the group on expiry, ``is_completed`` never blocks), and the
project's one way of waiting for a collective (``collective_wait.wait_for``) outlasts a slow
broadcast on it without aborting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.deadline import Deadline
from relax_launch.inference.process import free_port
from relax_launch.platform.nccl_semantics import (
    SLOW_BROADCAST_ENV,
    CommunicatorAborted,
    NcclSemanticsGroup,
)
from relax_launch.weights.broadcast_group import custom_group
from relax_launch.weights.collective_wait import CHECK_EVERY_S, wait_for


def one_rank_group(monkeypatch: pytest.MonkeyPatch, broadcast_s: float) -> NcclSemanticsGroup:
    monkeypatch.setenv(SLOW_BROADCAST_ENV, str(broadcast_s))
    return NcclSemanticsGroup(dist.HashStore(), 0, 1, timedelta(seconds=30))


def broadcast(group: NcclSemanticsGroup) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([torch.ones(4)], options)


def test_wait_with_a_timeout_counts_from_the_enqueue_and_aborts_the_group(monkeypatch):
    group = one_rank_group(monkeypatch, broadcast_s=0.6)
    work = broadcast(group)
    time.sleep(0.3)
    # 0.4 s from the enqueue, before the broadcast's 0.6 s: it expires (counted from the call,
    # 0.7 s, it would outlast the broadcast and return)
    with pytest.raises(CommunicatorAborted, match="communicator was aborted"):
        work.wait(timedelta(seconds=0.4))
    assert work.is_completed()  # failed, as an aborted NCCL work
    with pytest.raises(CommunicatorAborted):
        broadcast(group)  # the group is gone for every later collective


def test_a_slow_broadcast_is_not_done_until_its_time_and_is_completed_never_blocks(monkeypatch):
    group = one_rank_group(monkeypatch, broadcast_s=0.3)
    first, second = broadcast(group), broadcast(group)  # a stream: one after the other
    # not done yet, and said so without waiting (a blocking check would return done)
    assert not first.is_completed() and not second.is_completed()
    first.wait()  # no timeout: blocks until done, aborts nothing
    assert first.is_completed() and not second.is_completed()  # the second's time follows
    second.wait()
    assert second.is_completed()
    broadcast(group).wait()


def test_the_gloo_way_of_waiting_fails_on_it(monkeypatch):
    """The wait loop the sync had (a second at a time, the error read as "not yet") is correct
    under gloo: here, as under NCCL, its first expiry destroys the group."""
    group = one_rank_group(monkeypatch, broadcast_s=1.3)
    work = broadcast(group)
    with pytest.raises(CommunicatorAborted):
        for _ in range(3):
            try:
                work.wait(timedelta(seconds=1))
                break
            except CommunicatorAborted:
                if work.is_completed():  # the old receiver: "it failed, rather than timed out"
                    raise
    with pytest.raises(CommunicatorAborted):
        broadcast(group)


def test_wait_for_outlasts_a_slow_broadcast_and_keeps_the_group(monkeypatch):
    group = one_rank_group(monkeypatch, broadcast_s=CHECK_EVERY_S + 0.4)
    checks = []
    waited = wait_for(broadcast(group), Deadline(30), "a broadcast", lambda: checks.append(1))
    assert waited >= CHECK_EVERY_S + 0.3
    assert checks  # the caller's checks ran while it waited
    assert group.aborted is None
    wait_for(broadcast(group), Deadline(30), "a second broadcast")


def test_wait_for_gives_up_when_a_check_raises_or_the_deadline_passes(monkeypatch):
    group = one_rank_group(monkeypatch, broadcast_s=CHECK_EVERY_S + 1.0)

    def sender_gone() -> None:
        raise RuntimeError("the weight sender gave up this sync")

    with pytest.raises(RuntimeError, match="gave up"):
        wait_for(broadcast(group), None, "a broadcast", sender_gone)
    with pytest.raises(TimeoutError, match="a second broadcast"):
        wait_for(broadcast(group), Deadline(0.2), "a second broadcast")
    assert group.aborted is None


RECEIVER = """
import sys, torch, torch.distributed as dist
from relax_launch import platform
from relax_launch.weights.broadcast_group import custom_group
from relax_launch.weights.collective_wait import wait_for
group = custom_group(platform.weight_sync_backend("cpu"), "127.0.0.1", int(sys.argv[1]), 2, 1,
                     "collective-wait-test", 60)
received = torch.zeros(8)
waited = wait_for(dist.broadcast(received, group=group, group_src=0, async_op=True), None, "x")
print(waited, received.tolist(), flush=True)
dist.destroy_process_group(group)
"""


def test_a_broadcast_group_on_it_moves_the_tensor_and_slows_every_rank(monkeypatch):
    """Through torch.distributed's own broadcast, in a real two-rank group formed the way the
    sync forms it: the sender's setting reaches the other rank (its own process, started
    without it) through the group's store."""
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != SLOW_BROADCAST_ENV},
    )
    try:
        monkeypatch.setenv(SLOW_BROADCAST_ENV, "1.5")
        backend = platform.weight_sync_backend("cpu")
        group = custom_group(backend, "127.0.0.1", port, 2, 0, "collective-wait-test", 60)
        sent = torch.arange(8.0)
        work = dist.broadcast(sent, group=group, group_src=0, async_op=True)
        assert wait_for(work, Deadline(60), "the test broadcast") >= 1.4
        out, _ = receiver.communicate(timeout=60)
        waited, received = out.split(" ", 1)
        assert float(waited) >= 1.0  # it waited on its own slowed broadcast, unaborted
        assert json.loads(received) == sent.tolist()
        dist.destroy_process_group(group)
    finally:
        receiver.kill()
        receiver.wait(10)
