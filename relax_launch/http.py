"""The package's one HTTP client library: aiohttp.

Per request, aiohttp takes about a tenth of the CPU of httpx's async client (docs/gateway.md,
"Performance"), and the gateway and the controller each run on one event loop whose CPU is their
throughput. Blocking callers run the same coroutines: on a ``LoopThread`` where connections
are kept (the weight sync's control requests, the public ``InferenceClient``), with ``call``
for one-shot requests (readiness probes, engine control off the sync path, the CLI).
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
import orjson

T = TypeVar("T")
log = logging.getLogger("relax_launch.http")
# The transport failures of a request: refused, reset, dropped, a malformed reply.
TransportError = aiohttp.ClientError


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server is gone (refused or dropped), not merely slow."""
    return isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, TimeoutError)


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


def call(method: str, url: str, *, json: Any = None, timeout_s: float) -> Reply:
    """One blocking request on a connection and an event loop of its own (calls off the hot
    paths); not from a thread that runs an event loop (``await fetch`` there)."""
    return asyncio.run(_once(method, url, json, timeout_s))


async def _once(method: str, url: str, json: Any, timeout_s: float) -> Reply:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as http:
        return await fetch(http, method, url, json=json, timeout_s=timeout_s)


class LoopThread:
    """An event loop on a daemon thread: blocking code runs coroutines on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the loop; its result comes through the returned future."""
        if not self.thread.is_alive() or threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(
                f"{self.thread.name}: the event loop is closed, or this is its own thread"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

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
        """Cancel what still runs, await ``then`` (a session's close), stop the loop and join
        its thread, each bounded."""
        if not self.thread.is_alive():
            if then is not None:
                then.close()
            return
        done = asyncio.run_coroutine_threadsafe(_cancel_others(then), self.loop)
        try:
            done.result(timeout_s)
        except TimeoutError:
            log.warning(
                "%s: tasks did not end within %.0f s of closing", self.thread.name, timeout_s
            )
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("%s did not stop within %.0f s", self.thread.name, timeout_s)
        else:
            self.loop.close()


async def _open(**kwargs: Any) -> aiohttp.ClientSession:
    return session(**kwargs)


async def _cancel_others(then: Coroutine[Any, Any, Any] | None) -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    if then is not None:
        await then
    await asyncio.get_running_loop().shutdown_default_executor()
