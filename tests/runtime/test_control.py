"""The control channel over a real TCPStore: typed commands, replies, errors and timeouts that
name rank and role, and a store that holds nothing once a command is answered."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import pytest
import torch.distributed as dist

from relax_launch.runtime.control import (
    Command,
    ControlChannel,
    ControlTimeout,
    RemoteError,
    Shutdown,
)

ROLES = {0: "trainer[tp0 pp0 dp0]", 1: "rollout[e0 head]", 2: "teacher[e0 head]"}


@dataclass(frozen=True)
class Add(Command):
    op: ClassVar[str] = "add"
    a: int


@dataclass(frozen=True)
class Boom(Command):
    op: ClassVar[str] = "boom"


@dataclass(frozen=True)
class Work(Command):
    op: ClassVar[str] = "work"


@pytest.fixture
def stores():
    master = dist.TCPStore(  # port 0: the store binds a free port itself, no probe-then-bind race
        "127.0.0.1", 0, 3, True, timedelta(seconds=10), wait_for_workers=False
    )
    clients = [
        dist.TCPStore("127.0.0.1", master.port, 3, False, timedelta(seconds=10)) for _ in (1, 2)
    ]
    return [master, *clients]


def serve(store, rank, handlers, timeout_s=5.0):
    channel = ControlChannel(store, rank=rank, roles=ROLES, timeout_s=timeout_s)
    errors = []

    def loop():
        try:
            channel.serve(handlers)
        except ControlTimeout as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread, errors


def test_commands_run_on_their_ranks_and_errors_come_back_named(stores):
    def fail(command):
        raise ValueError("bad batch")

    workers = [serve(stores[r], r, {"add": lambda c, r=r: c.a + r, "boom": fail}) for r in (1, 2)]
    rank0 = ControlChannel(stores[0], rank=0, roles=ROLES, timeout_s=5)
    assert rank0.call(Add(5), [0, 1, 2], local=lambda c: c.a * 10) == {0: 50, 1: 6, 2: 7}
    assert rank0.call(Add(1), [2]) == {2: 3}
    with pytest.raises(
        RemoteError,
        match=r"#3 'boom' failed on rank 1 \(rollout\[e0 head\]\): ValueError: bad batch",
    ):
        rank0.call(Boom(), [1])
    rank0.call(Shutdown(), [0, 1, 2])
    for thread, errors in workers:
        thread.join(5)
        assert not thread.is_alive() and not errors
    rank0.close()


def test_a_rank_that_never_answers_is_named_with_its_role_and_op(stores):
    workers = [serve(stores[1], 1, {"work": lambda c: time.sleep(3)})]
    rank0 = ControlChannel(stores[0], rank=0, roles=ROLES, timeout_s=1)
    with pytest.raises(
        ControlTimeout,
        match=r"command #1 'work': no reply within 1 s from rank 1 \(rollout\[e0 head\]\), "
        r"rank 2 \(teacher\[e0 head\]\)",
    ):
        rank0.call(Work(), [1, 2])
    rank0.close()
    workers[0][0].join(10)


def test_a_worker_stops_when_the_controller_falls_silent(stores):
    rank0 = ControlChannel(stores[0], rank=0, roles=ROLES, timeout_s=1, heartbeat_s=0.1)
    time.sleep(0.3)
    rank0.close()  # heartbeat stops, no shutdown sent
    thread, errors = serve(stores[1], 1, {}, timeout_s=1)
    thread.join(10)
    assert errors and "the controller (rank 0) has been silent" in str(errors[0])
    assert "rank 1 (rollout[e0 head])" in str(errors[0])


def test_the_store_holds_no_command_or_reply_once_answered(stores):
    """Each rank deletes the command it took and rank 0 each reply: the store's keys and bytes
    stay as they were however many commands run."""
    workers = [serve(stores[r], r, {"add": lambda c: c.a}) for r in (1, 2)]
    rank0 = ControlChannel(stores[0], rank=0, roles=ROLES, timeout_s=5, heartbeat_s=0.05)

    def footprint() -> tuple[int, int]:
        keys = stores[0].list_keys()
        return len(keys), sum(len(stores[0].get(k)) for k in keys)

    rank0.call(Add(1), [1, 2])
    first = footprint()
    for step in range(10):
        assert rank0.call(Add(10**step), [1, 2]) == {1: 10**step, 2: 10**step}
        assert footprint() == first
    assert first[0] == 1  # the heartbeat alone
    rank0.call(Shutdown(), [1, 2])
    for thread, errors in workers:
        thread.join(5)
        assert not thread.is_alive() and not errors
    rank0.close()
