"""Upstream: the gateway's connection pool to the engines, with its error mapping.

Timeouts answer 504, transport failures 502; an upstream HTTP error keeps its status and body.
A stream is piped chunk by chunk, its upstream response closed exactly once (on the end, an
error, the deadline or the client's disconnect), and never replayed after its first chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import aiohttp
from fastapi import HTTPException, Response
from starlette.types import Receive, Scope, Send

from relax_launch import http
from relax_launch.inference.routing import ROUTING_KEY_HEADER

log = logging.getLogger("relax_launch.gateway")

# Only these request headers reach an engine; everything else (hop-by-hop, Connection-nominated,
# cookies, the client's routing key) stays at the gateway.
FORWARDED_REQUEST_HEADERS = (b"authorization", b"x-request-id")
RETURNED_RESPONSE_HEADERS = ("retry-after", "x-request-id")


def forwarded_headers(
    raw: Iterable[tuple[bytes, bytes]], routing_key: str | None = None
) -> dict[str, str]:
    """The headers sent upstream; ``routing_key`` goes to sglang-router under policy affinity."""
    headers = {k.decode(): v.decode("latin-1") for k, v in raw if k in FORWARDED_REQUEST_HEADERS}
    headers["content-type"] = "application/json"
    if routing_key is not None:
        headers[ROUTING_KEY_HEADER] = routing_key
    return headers


class Upstream:
    """One pooled session, created on the gateway's event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = http.session(limit=2048)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """POST and return the whole reply."""
        try:
            reply = await http.fetch(
                self.session, "POST", url, body=body, headers=headers, timeout_s=self.timeout_s
            )
        except (TimeoutError, http.TransportError) as exc:
            raise self._error(exc, url) from None
        returned = {k: reply.headers[k] for k in RETURNED_RESPONSE_HEADERS if k in reply.headers}
        returned["content-type"] = reply.headers.get("content-type", "application/json")
        return Response(reply.body, reply.status, returned)

    async def stream(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        partner: asyncio.Task | None = None,
    ) -> Response:
        """POST for an SSE reply; an upstream error before the first byte is an HTTP error.
        ``partner`` (a disaggregated pair's prefill half) ends only if it fails, which then ends
        the stream; it is cancelled with the stream."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
        try:
            response = await asyncio.wait_for(
                self.session.post(url, data=body, headers=headers, timeout=timeout), self.timeout_s
            )
        except (TimeoutError, http.TransportError) as exc:
            if partner is not None:
                partner.cancel()
            raise self._error(exc, url) from None
        if response.status == 200:
            return UpstreamStream(response, url, self.timeout_s, partner)
        if partner is not None:
            partner.cancel()
        try:
            data = await response.read()
        finally:
            response.close()
        content_type = response.headers.get("content-type", "application/json")
        return Response(data, response.status, {"content-type": content_type})

    def _error(self, exc: Exception, url: str) -> HTTPException:
        if isinstance(exc, TimeoutError):
            why = f"did not answer within {self.timeout_s:.0f} s"
            return HTTPException(504, f"upstream {url} {why}")
        return HTTPException(502, f"upstream {url} unavailable: {type(exc).__name__}: {exc}")


class UpstreamStream(Response):
    """An upstream SSE reply piped to the client until it ends, fails, passes the deadline or
    the client disconnects (Starlette's StreamingResponse has no deadline and, under uvicorn,
    notices a disconnect only on its next write, which a stalled upstream never makes)."""

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        url: str,
        deadline_s: float,
        partner: asyncio.Task | None = None,
    ) -> None:
        self.upstream, self.url, self.deadline_s = upstream, url, deadline_s
        self.partner = partner
        self.status_code, self.background = 200, None
        content_type = upstream.headers.get("content-type", "text/event-stream")
        # no body set, so no content-length: the reply is chunked, as its length is unknown
        self.init_headers({"content-type": content_type, "cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await self._pipe(send, receive)
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.upstream.close()  # exactly once, whatever ended the stream
            if self.partner is not None:
                self.partner.cancel()

    async def _pipe(self, send: Send, receive: Receive) -> None:
        pump = asyncio.ensure_future(_relay(send, self.upstream))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watched = {pump, watcher} | ({self.partner} if self.partner is not None else set())
        try:
            done, _ = await asyncio.wait(
                watched, timeout=self.deadline_s, return_when=asyncio.FIRST_COMPLETED
            )
            if self.partner in done:
                why = self.partner.exception() or "its prefill half ended"
                log.warning("closing upstream stream %s: %s", self.url, why)
            elif pump not in done:
                why = "client disconnected" if watcher in done else "stream deadline passed"
                log.warning("closing upstream stream %s: %s", self.url, why)
            elif pump.exception() is not None:
                why = pump.exception()
                log.warning("upstream stream %s failed midway (not replayed): %s", self.url, why)
        finally:
            for task in (pump, watcher):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


async def _relay(send: Send, response: aiohttp.ClientResponse) -> None:
    async for chunk in response.content.iter_any():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
