"""The control channel: rank 0 sends numbered typed commands, ranks reply, errors come back named.

Commands are small frozen dataclasses (``Command``), kept in the torchrun store, no collective:
a rank that is busy or gone is detected by a deadline and named, not waited on forever. Rank 0
posts command ``n`` in each targeted rank's own queue; the rank takes it (deleting the key), runs
the handler registered for the command's ``route`` and posts a reply with its rank, roles and
either a result or the error; rank 0 takes each reply (deleting it too), so the store holds only
the commands and replies in flight. Rank 0 heartbeats while it lives; a worker whose controller
falls silent stops.

Bulk data (batch shards, per-token results) never goes through the store: it travels over
torch.distributed (``runtime/distributed.py``), started between ``post`` and ``collect``.
"""

from __future__ import annotations

import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist

from relax_launch.deadline import Deadline

POLL_S = (0.001, 0.02)  # a waiting rank polls the store this often: first, and at the slowest
# rank 0 waits for a command's replies this long beyond the deadline it gave the ranks, before
# their silence is the error (their own deadline's error is the better message)
REPLY_MARGIN_S = 15.0


@dataclass(frozen=True)
class Command:
    """One command record; subclasses add the arguments. ``op`` names it in every message."""

    op: ClassVar[str] = ""

    @property
    def route(self) -> str:
        """The handler key; a command answered by several workers of one rank refines it."""
        return self.op


@dataclass(frozen=True)
class Shutdown(Command):
    op: ClassVar[str] = "shutdown"


Handler = Callable[[Any], Any]  # takes the command record


class RemoteError(RuntimeError):
    """One or more ranks failed a command; the message names each rank, its roles and error."""


class ControlTimeout(TimeoutError):
    """Ranks did not answer a command in time; the message names them, their roles and the op."""


@dataclass(frozen=True)
class Reply:
    rank: int
    roles: str
    ok: bool
    value: Any = None
    error: str = ""


@dataclass(frozen=True)
class Posted:
    """A command rank 0 has posted and not yet collected."""

    n: int
    command: Command
    ranks: tuple[int, ...]


class ControlChannel:
    """Both ends of the channel; rank 0 calls ``call`` (or ``post`` then ``collect``), other
    ranks ``serve``."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        roles: dict[int, str],
        timeout_s: float,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.store, self.rank, self.roles, self.timeout_s = store, rank, roles, timeout_s
        self.heartbeat_s = heartbeat_s
        self.next_id = 0  # rank 0: the last command number
        self.queued: dict[int, int] = {}  # commands posted to (rank 0) or taken by each rank
        self._stop = threading.Event()
        self._posting = threading.Lock()
        self._beat: threading.Thread | None = None
        if rank == 0:
            self._beat = threading.Thread(
                target=self._heartbeat, name="control-heartbeat", daemon=True
            )
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            # fixed width: the store's size does not drift with the clock
            self.store.set("control/heartbeat", f"{time.time():.3f}")
            self._stop.wait(self.heartbeat_s)

    def call(
        self,
        command: Command,
        ranks: Iterable[int],
        local: Handler | None = None,
        timeout_s: float | None = None,
    ) -> dict[int, Any]:
        """Run ``command`` on ``ranks`` (rank 0 runs ``local`` itself) and return each rank's
        result."""
        return self.collect(self.post(command, ranks), local, timeout_s)

    def post(self, command: Command, ranks: Iterable[int]) -> Posted:
        """Put ``command`` in the queue of each targeted rank other than 0."""
        with self._posting:  # a scale operation's thread posts beside the RL program's
            posted = Posted(self.next_id + 1, command, tuple(sorted(set(ranks))))
            self.next_id = posted.n
            record = pickle.dumps((posted.n, command))
            others = [r for r in posted.ranks if r != 0]
            for r in others:
                self.queued[r] = self.queued.get(r, 0) + 1
            if others:
                self.store.multi_set(
                    [command_key(r, self.queued[r]) for r in others], [record] * len(others)
                )
        return posted

    def collect(
        self, posted: Posted, local: Handler | None = None, timeout_s: float | None = None
    ) -> dict[int, Any]:
        """Run rank 0's share (``local``) if it is targeted, then wait for every other rank's
        reply; raise naming the ranks that failed or did not answer in time."""
        replies = {}
        if 0 in posted.ranks:
            replies[0] = _run(0, self.roles[0], local, posted.command)
        others = [r for r in posted.ranks if r != 0]
        replies.update(self._take_replies(posted, others, timeout_s or self.timeout_s))
        _raise_failed(posted, replies.values())
        return {r: reply.value for r, reply in replies.items()}

    def raise_failed(self, posted: Posted, ranks: Iterable[int]) -> None:
        """Raise now, as ``collect`` would, the error of any of ``ranks`` (not 0) that already
        replied to ``posted`` with one; the replies stay for ``collect``."""
        keys = [reply_key(posted.n, r) for r in ranks]
        _raise_failed(
            posted, [pickle.loads(self.store.get(k)) for k in keys if self.store.check([k])]
        )

    def _take_replies(self, posted: Posted, ranks: list[int], timeout_s: float) -> dict[int, Reply]:
        keys = {r: reply_key(posted.n, r) for r in ranks}
        deadline = Deadline(timeout_s)
        pause = POLL_S[0]
        while ranks and not self.store.check(list(keys.values())):
            if deadline.passed:
                late = [r for r in ranks if not self.store.check([keys[r]])]
                raise ControlTimeout(
                    f"command #{posted.n} {posted.command.op!r}: no reply within "
                    f"{timeout_s:.0f} s from "
                    + ", ".join(f"rank {r} ({self.roles[r]})" for r in late)
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        replies = {}
        for r, key in keys.items():
            replies[r] = pickle.loads(self.store.get(key))
            self.store.delete_key(key)
        return replies

    def serve(self, handlers: dict[str, Handler]) -> None:
        """Worker loop: run each command in this rank's queue until ``Shutdown``."""
        while True:
            n, command = pickle.loads(self._take_command())
            reply = _run(self.rank, self.roles[self.rank], handlers.get(command.route), command)
            self.store.set(reply_key(n, self.rank), pickle.dumps(reply))
            if isinstance(command, Shutdown):
                return

    def _take_command(self) -> bytes:
        index = self.queued.get(self.rank, 0) + 1
        key = command_key(self.rank, index)
        pause, beat_checked = POLL_S[0], time.monotonic()
        while not self.store.check([key]):
            if time.monotonic() - beat_checked > self.heartbeat_s:
                self._check_controller_alive(index)
                beat_checked = time.monotonic()
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        record = self.store.get(key)
        self.store.delete_key(key)
        self.queued[self.rank] = index
        return record

    def _check_controller_alive(self, index: int) -> None:
        beat = self.store.check(["control/heartbeat"]) and float(
            self.store.get("control/heartbeat")
        )
        if beat and time.time() - beat > self.timeout_s:
            raise ControlTimeout(
                f"rank {self.rank} ({self.roles[self.rank]}): the controller (rank 0) has been "
                f"silent for {time.time() - beat:.0f} s while this rank waited for its command "
                f"{index}"
            )

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)


def command_key(rank: int, index: int) -> str:
    """The store key of the ``index``-th command queued for ``rank``."""
    return f"control/cmd/{rank}/{index}"


def reply_key(n: int, rank: int) -> str:
    return f"control/reply/{n}/{rank}"


def _raise_failed(posted: Posted, replies: Iterable[Reply]) -> None:
    failed = [r for r in replies if not r.ok]
    if failed:
        raise RemoteError(
            f"command #{posted.n} {posted.command.op!r} failed on "
            + "; ".join(f"rank {r.rank} ({r.roles}): {r.error}" for r in failed)
        )


def _run(rank: int, roles: str, handler: Handler | None, command: Command) -> Reply:
    if handler is None:
        ok = isinstance(command, Shutdown)
        return Reply(rank, roles, ok=ok, error=f"no handler for {command.route!r}")
    try:
        return Reply(rank, roles, ok=True, value=handler(command))
    except Exception as exc:  # noqa: BLE001 - carried back to rank 0 with rank and role
        return Reply(
            rank,
            roles,
            ok=False,
            error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}",
        )
