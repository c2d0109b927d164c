"""HTTP to SGLang engines' control routes: keep-alive connections for weight sync, and one-shot
calls for everything else.

A sync sends a few requests per engine, each of which the engine answers only once the sender
has joined a collective, so ``EngineControl`` runs requests on a small thread pool, awaited later,
over an ``httpx.Client`` that keeps a connection open per engine between syncs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import httpx


class EngineRequestError(RuntimeError):
    """An engine answered a control request with an error, or not at all."""


class EngineUnreachable(EngineRequestError):
    """The engine refused the connection or dropped it: its server is gone (not merely slow)."""


class EngineControl:
    """Blocking and background POSTs to engines over kept-alive connections."""

    def __init__(self) -> None:
        self.http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=64), timeout=None)
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-control")

    def post(self, url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST JSON and return the parsed reply; raise EngineRequestError on any failure."""
        return _call(self.http.post, url + path, json=body or {}, timeout=timeout_s)

    def submit(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> Future:
        """The same POST on the pool: the engine may block in a collective we are about to join."""
        return self.pool.submit(self.post, url, path, body, timeout_s)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


def _call(method: Any, where: str, **kwargs: Any) -> Any:
    try:
        response = method(where, **kwargs)
    except httpx.HTTPError as exc:  # connection refused/reset, timeout
        gone = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)
        error = EngineUnreachable if gone else EngineRequestError
        raise error(f"{where}: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise EngineRequestError(
            f"{where}: HTTP {response.status_code}: {response.content[:500]!r}"
        )
    try:
        reply = response.json() if response.content else None
    except ValueError:
        return response.text
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineRequestError(f"{where}: {reply.get('message')}")
    return reply


def post(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One POST on a connection of its own (calls off the weight-sync path)."""
    return _call(httpx.post, url + path, json=body or {}, timeout=timeout_s)


def get_json(url: str, path: str, timeout_s: float) -> Any:
    return _call(httpx.get, url + path, timeout=timeout_s)


def result(call: Future, timeout_s: float) -> Any:
    """The reply of a submitted request, waiting at most ``timeout_s``."""
    try:
        return call.result(timeout=max(timeout_s, 0.0))
    except FutureTimeout:
        raise EngineRequestError(f"no reply within {timeout_s:.0f} s") from None
