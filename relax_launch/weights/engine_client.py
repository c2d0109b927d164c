"""HTTP to SGLang engines' control routes: kept-alive connections for weight sync, and one-shot
calls for everything else.

A sync sends a few requests per engine, each of which the engine answers only once the sender
has joined a collective, so ``EngineControl`` starts requests on its own event loop, awaited
later, over one session that keeps a connection open per engine between syncs.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from relax_launch import http

if TYPE_CHECKING:
    import aiohttp

# a blocking call waits this much longer than its request's own deadline before giving up
LOOP_MARGIN_S = 5.0


class EngineRequestError(RuntimeError):
    """An engine answered a control request with an error, or not at all."""


class EngineUnreachable(EngineRequestError):
    """The engine refused the connection or dropped it: its server is gone (not merely slow)."""


class EngineControl:
    """Blocking and background POSTs to engines over kept-alive connections."""

    def __init__(self) -> None:
        self.loop = http.LoopThread("engine-control")
        self.session = self.loop.session(limit=64)

    def post(self, url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST JSON and return the parsed reply; raise EngineRequestError on any failure."""
        return result(self.submit(url, path, body or {}, timeout_s), timeout_s + LOOP_MARGIN_S)

    def submit(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> Future:
        """The same POST, started now: the engine may block in a collective we are about to
        join."""
        return self.loop.submit(_post(self.session, url + path, body, timeout_s))

    def close(self) -> None:
        try:
            self.loop.run(self.session.close(), LOOP_MARGIN_S, "closing engine connections")
        finally:
            self.loop.close()


async def _post(
    session: aiohttp.ClientSession, where: str, body: dict[str, Any], timeout_s: float
) -> Any:
    try:
        reply = await http.fetch(session, "POST", where, json=body, timeout_s=timeout_s)
    except (http.TransportError, TimeoutError) as exc:
        raise _failure(where, exc) from None
    return _parsed(where, reply)


def _failure(where: str, exc: BaseException) -> EngineRequestError:
    """Connection refused/reset: the engine is gone; a timeout: it is slow."""
    error = EngineUnreachable if http.unreachable(exc) else EngineRequestError
    why = str(exc) or "no reply in time"
    return error(f"{where}: {type(exc).__name__}: {why}")


def _parsed(where: str, reply: http.Reply) -> Any:
    if not reply.ok:
        raise EngineRequestError(f"{where}: HTTP {reply.status}: {reply.body[:500]!r}")
    try:
        parsed = reply.json() if reply.body else None
    except ValueError:
        return reply.text
    if isinstance(parsed, dict) and parsed.get("success") is False:
        raise EngineRequestError(f"{where}: {parsed.get('message')}")
    return parsed


def _blocking(method: str, where: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    try:
        reply = http.call(method, where, json=body, timeout_s=timeout_s)
    except (http.TransportError, TimeoutError) as exc:
        raise _failure(where, exc) from None
    return _parsed(where, reply)


def post(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One POST on a connection of its own (calls off the weight-sync path)."""
    return _blocking("POST", url + path, body or {}, timeout_s)


def get_json(url: str, path: str, timeout_s: float) -> Any:
    return _blocking("GET", url + path, None, timeout_s)


def result(call: Future, timeout_s: float) -> Any:
    """The reply of a submitted request, waiting at most ``timeout_s``."""
    try:
        return call.result(timeout=max(timeout_s, 0.0))
    except FutureTimeout:
        raise EngineRequestError(f"no reply within {timeout_s:.0f} s") from None
