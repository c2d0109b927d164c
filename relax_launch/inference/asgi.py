"""The few ASGI building blocks the gateway needs: read a bounded body, send a reply, errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = Iterable[tuple[str, str]]


class HttpError(Exception):
    """Answer ``status`` with ``{"error": {"message", "code"}}`` (plus headers)."""

    def __init__(self, status: int, message: str, headers: Headers = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, list(headers)


def header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: dict[str, Any], receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HttpError(499, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise HttpError(400, "request body must be a JSON object")
    return payload


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: str, headers: Headers = ()
) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any, headers: Headers = ()) -> None:
    await send_bytes(send, status, orjson.dumps(payload), "application/json", headers)


async def send_error(send: Send, error: HttpError) -> None:
    payload = {"error": {"message": error.message, "code": error.status}}
    await send_json(send, error.status, payload, error.headers)
