"""The package's one HTTP client library: aiohttp.

Per request, aiohttp takes about a tenth of the CPU of httpx's async client (docs/gateway.md,
"Performance"), and the gateway and the controller each run on one event loop whose CPU is their
throughput. Blocking callers run the same coroutines: on a ``Portal`` (anyio's blocking
portal) where connections are kept (the weight sync's control requests, the public
``InferenceClient``), with ``call`` for one-shot requests (readiness probes, engine control off
the sync path, the CLI).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import anyio
import orjson
from anyio.from_thread import BlockingPortal

T = TypeVar("T")
log = logging.getLogger("relax_launch.http")
# The transport failures of a request: refused, reset, dropped, a malformed reply.
TransportError = aiohttp.ClientError


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server is gone (refused or dropped), not merely slow."""
    return isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, TimeoutError)


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a refused connection: the host answers, but nothing listens on the
    port (the server's process is gone), unlike a timeout or a dropped connection."""
    return isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
        exc.os_error, ConnectionRefusedError
    )


@dataclass(frozen=True)
class Reply:
    """A whole HTTP reply, read before its connection went back to the pool."""

    status: int
    headers: Mapping[str, str]  # case-insensitive
    body: bytes

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The parsed body; ``ValueError`` if it is not JSON."""
        return orjson.loads(self.body)

    def raise_for_status(self) -> Reply:
        """Itself, or ``TransportError`` naming an error status (e.g. a router's 503 while it
        has no healthy worker)."""
        if not self.ok:
            raise TransportError(f"HTTP {self.status}: {self.text[:200]}")
        return self


def session(*, limit: int = 100, keepalive_s: float = 15.0) -> aiohttp.ClientSession:
    """A pooled session for the running loop: replies are read as sent (no decompression), no
    proxy from the environment (engines are reached directly), deadlines per request."""
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=keepalive_s)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=timeout(None))


@functools.lru_cache(maxsize=64)
def timeout(seconds: float | None) -> aiohttp.ClientTimeout:
    """A deadline for a whole request (None: none); built once per value, as building one costs
    about as much as the rest of a proxied request's own bookkeeping."""
    return aiohttp.ClientTimeout(total=seconds)


async def fetch(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    json: Any = None,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> Reply:
    """One request, its whole reply read; raises ``TransportError`` or ``TimeoutError``."""
    sent = dict(headers or {})
    if json is not None:
        body = orjson.dumps(json)
        sent.setdefault("content-type", "application/json")
    async with http.request(method, url, data=body, headers=sent, timeout=timeout(timeout_s)) as r:
        return Reply(r.status, r.headers, await r.read())  # parsed headers outlive the reply


def call(
    method: str,
    url: str,
    *,
    json: Any = None,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One blocking request on a connection and an event loop of its own (calls off the hot
    paths); not from a thread that runs an event loop (``await fetch`` there)."""
    return asyncio.run(_once(method, url, json, timeout_s, headers))


async def _once(
    method: str, url: str, json: Any, timeout_s: float, headers: Mapping[str, str] | None
) -> Reply:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as http:
        return await fetch(http, method, url, json=json, headers=headers, timeout_s=timeout_s)


class Portal:
    """anyio's ``BlockingPortal`` on a daemon thread of its own (``name``): blocking code runs
    coroutines and calls on its event loop, each wait bounded and named. Daemon, unlike
    ``anyio.from_thread.start_blocking_portal``'s pool thread, so a loop stuck in a library can
    never hold the process open at exit."""

    def __init__(self, name: str, start_s: float = 10.0) -> None:
        started: Future[BlockingPortal] = Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                started.set_result(portal)
                await portal.sleep_until_stopped()

        self.thread = threading.Thread(target=anyio.run, args=(serve,), name=name, daemon=True)
        self.thread.start()
        self.portal = started.result(start_s)

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the loop; its result comes through the returned future (cancel
        the future to cancel it)."""
        if not self.running or threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(f"{self.thread.name}: the portal is closed, or this is its thread")
        return self.portal.start_task_soon(_awaited, coro)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None, what: str) -> T:
        """``coro``'s result; after ``timeout_s`` it is cancelled and ``TimeoutError`` names
        ``what`` was waited for."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s") from None

    def session(self, **kwargs: Any) -> aiohttp.ClientSession:
        """A ``session(**kwargs)`` opened on this loop, for coroutines run on it."""
        return self.run(_open(**kwargs), 10.0, f"{self.thread.name}: opening a session")

    def close(self, timeout_s: float = 10.0, then: Coroutine[Any, Any, Any] | None = None) -> None:
        """Await ``then`` (a session's close), cancel what still runs, stop the loop and join
        its thread, each bounded by ``timeout_s``."""
        if not self.running:
            if then is not None:
                then.close()
            return
        try:
            if then is not None:
                self.run(then, timeout_s, f"{self.thread.name}: closing")
            self.portal.start_task_soon(self.portal.stop, True).result(timeout_s)
        except Exception as exc:  # noqa: BLE001 - closing goes on; the thread is a daemon
            log.warning("%s: closing: %s: %s", self.thread.name, type(exc).__name__, exc)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("%s did not stop within %.0f s", self.thread.name, timeout_s)


async def _awaited(coro: Coroutine[Any, Any, T]) -> T:
    return await coro


async def _open(**kwargs: Any) -> aiohttp.ClientSession:
    return session(**kwargs)
