"""A scripted HTTP upstream (a real server on 127.0.0.1) that records what the gateway sends.

Used where a test must prove what reached an engine — nothing, once, which headers, whether a
stream was closed — or script failures a real engine cannot be made to show on demand.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import uvicorn

from relax_launch.deadline import Deadline

HOLD_S = 300  # a held request's bound: only a test that never releases it reaches this
SSE_CHUNKS = [b'data: {"a": 1}\n\n', b'data: {"b": "\xc3\xa9"}\n', b"\n", b"data: [DONE]\n\n"]


class FakeUpstream:
    """``mode``: ok | held | fail_after_first | hang_after_first | error_400 | score.
    ``held``: each request stays in flight until ``release()`` or the next ``reset`` (not for
    a fixed time: on a loaded machine that may end before the test did what must happen while
    the request is in flight)."""

    def __init__(self, port: int = 0) -> None:
        self.mode = "ok"
        self.requests: list[dict[str, Any]] = []
        self.disconnects = 0
        self.answered = 0  # whole (non-streamed) replies sent
        self.lock = threading.Lock()
        self.released = threading.Event()
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=port,
                log_level="error",
                lifespan="off",
                interface="asgi3",
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeUpstream:
        self.thread.start()
        deadline = time.monotonic() + 60  # only a hang: a loaded machine starts it late
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "fake upstream down"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.release()  # a request held by a test that failed before its release ends now
        self.server.should_exit = True
        self.thread.join(10)

    def reset(self, mode: str = "ok") -> None:
        with self.lock:
            self.mode, self.requests, self.disconnects, self.answered = mode, [], 0, 0
            self.released.set()  # those held before
            self.released = threading.Event()

    def release(self) -> None:
        """Answer the requests held (mode ``held``), and those that come later."""
        self.released.set()

    async def app(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        with self.lock:
            self.requests.append({"path": scope["path"], "headers": headers, "body": body})
        payload = json.loads(body or b"{}")
        if self.mode == "held":
            released, held = self.released, Deadline(HOLD_S)
            while not released.is_set() and not held.passed:
                await asyncio.sleep(0.01)
        if self.mode == "error_400":
            return await self._reply(send, 400, b'{"error": "bad sampling"}', "application/json")
        if payload.get("stream"):
            return await self._stream(receive, send)
        echo = {"path": scope["path"], "received": payload, "text": "  judged: 7  "}
        if self.mode == "score":  # a teacher's: each input token's logprob from the start asked
            start = payload.get("logprob_start_len", 0)
            scored = payload.get("input_ids", [])[start:]
            echo["meta_info"] = {"input_token_logprobs": [[-0.5, t, None] for t in scored]}
        await self._reply(send, 200, json.dumps(echo).encode(), "application/json")

    async def _reply(self, send, status: int, body: bytes, content_type: str) -> None:
        headers = [(b"content-type", content_type.encode()), (b"x-request-id", b"upstream-1")]
        headers.append((b"connection", b"keep-alive"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        with self.lock:
            self.answered += 1

    async def _stream(self, receive, send) -> None:
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        chunks = SSE_CHUNKS if self.mode == "ok" else SSE_CHUNKS[:1]
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0.02)
        if self.mode == "fail_after_first":
            raise RuntimeError("upstream dies mid-stream")  # uvicorn drops the connection
        if self.mode == "hang_after_first":
            while (await receive())["type"] != "http.disconnect":
                pass
            with self.lock:
                self.disconnects += 1
            return
        await send({"type": "http.response.body", "body": b""})
