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

from relax_launch.inference.asgi import HttpError, Receive, Send, send_bytes
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
    """One pooled aiohttp session, created on the gateway's event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=2048, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(self, send: Send, url: str, body: bytes, headers: dict[str, str]) -> int:
        """POST and relay the whole reply; returns its status."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.post(url, data=body, headers=headers, timeout=timeout) as r:
                data = await r.read()
                status, content_type = r.status, r.headers.get("content-type", "application/json")
                returned = [(k, r.headers[k]) for k in RETURNED_RESPONSE_HEADERS if k in r.headers]
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._error(exc, url) from None
        await send_bytes(send, status, data, content_type, returned)
        return status

    async def stream(
        self, send: Send, receive: Receive, url: str, body: bytes, headers: dict[str, str]
    ) -> int:
        """POST and pipe the SSE reply; an upstream error before the first byte is an HTTP error."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
        try:
            response = await asyncio.wait_for(
                self.session.post(url, data=body, headers=headers, timeout=timeout), self.timeout_s
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._error(exc, url) from None
        try:
            if response.status != 200:
                data = await response.read()
                content_type = response.headers.get("content-type", "application/json")
                await send_bytes(send, response.status, data, content_type)
                return response.status
            await self._pipe(send, receive, response, url)
            return 200
        finally:
            response.close()  # exactly once, whatever ended the stream

    def _error(self, exc: Exception, url: str) -> HttpError:
        if isinstance(exc, TimeoutError):
            return HttpError(504, f"upstream {url} did not answer within {self.timeout_s:.0f} s")
        return HttpError(502, f"upstream {url} unavailable: {type(exc).__name__}: {exc}")

    async def _pipe(
        self, send: Send, receive: Receive, response: aiohttp.ClientResponse, url: str
    ) -> None:
        content_type = response.headers.get("content-type", "text/event-stream").encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", content_type), (b"cache-control", b"no-cache")],
            }
        )
        pump = asyncio.ensure_future(_relay(send, response))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                {pump, watcher}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if pump not in done:
                why = "client disconnected" if watcher in done else "stream deadline passed"
                log.warning("closing upstream stream %s: %s", url, why)
            elif pump.exception() is not None:
                log.warning(
                    "upstream stream %s failed midway (not replayed): %s", url, pump.exception()
                )
        finally:
            for task in (pump, watcher):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _relay(send: Send, response: aiohttp.ClientResponse) -> None:
    async for chunk in response.content.iter_any():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
