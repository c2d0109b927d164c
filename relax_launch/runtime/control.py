"""The control channel: rank 0 sends numbered commands, ranks reply, errors come back named.

Commands travel through the torchrun store (no collective, so a rank that is busy or gone is
detected by a deadline and named, not waited on forever). Rank 0 posts command ``n``; each
targeted rank runs its handler and posts a reply with its rank, roles and either a result or the
error. Rank 0 heartbeats while it lives; a worker whose controller falls silent stops.
"""

from __future__ import annotations

import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

Handler = Callable[..., Any]
SHUTDOWN = "shutdown"


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


class ControlChannel:
    """Both ends of the channel; rank 0 calls ``call``, other ranks ``serve``."""

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
        self.next_id = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if rank == 0:
            self._beat = threading.Thread(
                target=self._heartbeat, name="control-heartbeat", daemon=True
            )
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            self.store.set("control/heartbeat", str(time.time()))
            self._stop.wait(self.heartbeat_s)

    def call(
        self,
        op: str,
        ranks: Iterable[int],
        local: Handler | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Run ``op`` on ``ranks`` (rank 0 runs ``local`` itself) and return each rank's result."""
        ranks = sorted(set(ranks))
        n = self.next_id = self.next_id + 1
        self.store.set(f"control/cmd/{n}", pickle.dumps((op, ranks, kwargs)))
        replies = {}
        if 0 in ranks:
            replies[0] = _run(0, self.roles[0], local, kwargs, op)
        others = [r for r in ranks if r != 0]
        replies.update(self._collect(n, op, others, timeout_s or self.timeout_s))
        failed = [r for r in replies.values() if not r.ok]
        if failed:
            raise RemoteError(
                f"command #{n} {op!r} failed on "
                + "; ".join(f"rank {r.rank} ({r.roles}): {r.error}" for r in failed)
            )
        return {r: reply.value for r, reply in replies.items()}

    def _collect(self, n: int, op: str, ranks: list[int], timeout_s: float) -> dict[int, Reply]:
        keys = {r: f"control/reply/{n}/{r}" for r in ranks}
        deadline = time.monotonic() + timeout_s
        while ranks and not self.store.check(list(keys.values())):
            if time.monotonic() > deadline:
                late = [r for r in ranks if not self.store.check([keys[r]])]
                raise ControlTimeout(
                    f"command #{n} {op!r}: no reply within {timeout_s:.0f} s from "
                    + ", ".join(f"rank {r} ({self.roles[r]})" for r in late)
                )
            time.sleep(0.002)
        return {r: pickle.loads(self.store.get(k)) for r, k in keys.items()}

    def serve(self, handlers: dict[str, Handler]) -> None:
        """Worker loop: run each command addressed to this rank until ``shutdown``."""
        while True:
            n = self.next_id = self.next_id + 1
            op, ranks, kwargs = pickle.loads(self._await_command(n))
            if self.rank in ranks:
                reply = _run(self.rank, self.roles[self.rank], handlers.get(op), kwargs, op)
                self.store.set(f"control/reply/{n}/{self.rank}", pickle.dumps(reply))
            if op == SHUTDOWN:
                return

    def _await_command(self, n: int) -> bytes:
        key = f"control/cmd/{n}"
        while not self.store.check([key]):
            beat = self.store.check(["control/heartbeat"]) and float(
                self.store.get("control/heartbeat")
            )
            if beat and time.time() - beat > self.timeout_s:
                raise ControlTimeout(
                    f"rank {self.rank} ({self.roles[self.rank]}): the controller (rank 0) has been "
                    f"silent for {time.time() - beat:.0f} s while this rank waited for command #{n}"
                )
            time.sleep(0.005)
        return self.store.get(key)

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)


def _run(
    rank: int, roles: str, handler: Handler | None, kwargs: dict[str, Any], op: str = ""
) -> Reply:
    if handler is None:
        return Reply(rank, roles, ok=op == SHUTDOWN, error=f"no handler for {op!r}")
    try:
        return Reply(rank, roles, ok=True, value=handler(**kwargs))
    except Exception as exc:  # noqa: BLE001 - carried back to rank 0 with rank and role
        return Reply(
            rank,
            roles,
            ok=False,
            error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}",
        )
